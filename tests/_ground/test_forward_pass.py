"""The turn at PyTorch's one forward-AD level, and a forward pass's set-up."""
import threading

import pytest
import torch
from torch.autograd import forward_ad

from mixedad._ground.errors import NeedsWholeG
from mixedad._ground.forward_pass import FORWARD_PASS_LOCK, forward_pass


class Rules:  # what forward_pass reads of a pass's dispatch
    def __init__(self, attention):
        self.attention = attention


def test_grad_is_on_inside_and_as_before_after():
    with torch.no_grad():
        with forward_pass(Rules(True)):
            assert torch.is_grad_enabled()
        assert not torch.is_grad_enabled()


def test_inside_the_callers_own_dual_level_the_pass_needs_the_whole_g_fallback():
    with forward_ad.dual_level():
        with pytest.raises(NeedsWholeG, match="cannot nest forward-mode AD"):
            with forward_pass(Rules(True)):
                pass
    assert FORWARD_PASS_LOCK.acquire(blocking=False)  # released after the refusal
    FORWARD_PASS_LOCK.release()


def test_one_thread_at_a_time_holds_the_level_and_the_lock_is_reentrant():
    other_got_it = []
    with forward_pass(Rules(True)):
        with forward_pass(Rules(True)):  # a rule's own pass inside its caller's
            thread = threading.Thread(target=lambda: other_got_it.append(FORWARD_PASS_LOCK.acquire(timeout=0.05)))
            thread.start()
            thread.join()
    assert other_got_it == [False]
    assert FORWARD_PASS_LOCK.acquire(blocking=False)
    FORWARD_PASS_LOCK.release()


def test_without_the_attention_rule_attention_runs_on_a_backend_forward_ad_can_differentiate():
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    with forward_pass(Rules(False)), forward_ad.dual_level():
        dual = forward_ad.make_dual(q, torch.ones_like(q))
        out = torch.nn.functional.scaled_dot_product_attention(dual, dual, dual)
        assert forward_ad.unpack_dual(out).tangent is not None
