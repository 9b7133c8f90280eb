"""The one mode that sees a pass's ops first: generators at first sight, and the tensors a saved pass reads."""
import torch

from mixedad._ground import random_state, watch
from mixedad._ground.random_state import RandomState


def test_the_watch_is_one_mode_taken_off_by_a_dispatch_that_notes_generators_itself():
    depth = torch._C._len_torch_function_stack
    start = depth()
    outer, inner = RandomState(), RandomState()
    with random_state.watching(outer):
        assert depth() == start + 1
        with random_state.watching(inner):
            assert depth() == start + 1  # nested watches share the mode
            with watch.off():
                assert depth() == start
                gen = torch.Generator().manual_seed(6)
                watch.note_generators((), {"generator": gen})  # what mixedad's dispatch does for each op
                with watch.ops():  # code below the dispatch: a mode of its own
                    assert depth() == start + 1
            assert depth() == start + 1
    assert depth() == start
    assert gen in outer.generators and gen in inner.generators


def test_reads_are_the_tensors_the_pass_did_not_make_and_keep_the_mode_on():
    W, b = torch.randn(3, 3), torch.randn(3)
    reads = watch.Reads()
    depth = torch._C._len_torch_function_stack
    with watch.observing("reads", reads):
        x = torch.ones(2, 3)  # made here
        h = torch.cat([x @ W, x], dim=0) + b  # W and b read; x, x @ W made
        torch.tanh(h)
        start = depth()
        with watch.off():  # reads are watched: the mode stays
            assert depth() == start
    assert [id(t) for t in reads.tensors] == [id(W), id(b)]
