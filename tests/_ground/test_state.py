"""mixedad leaves the user's objects as the naive code does: untouched, or buffers stepped as it steps them."""
import io

import pytest
import torch
from torch import nn

import mixedad
from mixedad import zoo
from mixedad.reference import double_backward_input_grad, double_backward_mixed_grad
from mixedad._ground.state import SMALL_BUFFER_BYTES, Snapshot
from mixedad.testing import assert_close

F64 = torch.float64


def snapshot(G):
    return {
        "requires_grad": {n: p.requires_grad for n, p in G.named_parameters()},
        "grad": {n: p.grad for n, p in G.named_parameters()},
        "params": {n: p.detach().clone() for n, p in G.named_parameters()},
        "buffers": {n: b.clone() for n, b in G.named_buffers()},
        "training": {n: m.training for n, m in G.named_modules()},
    }


def assert_same(before, after):
    assert before["requires_grad"] == after["requires_grad"]
    assert all(after["grad"][n] is before["grad"][n] for n in before["grad"])
    for key in ("params", "buffers"):
        assert before[key].keys() == after[key].keys()
        for n in before[key]:
            assert torch.equal(before[key][n], after[key][n]), f"{key} {n} changed"
    assert before["training"] == after["training"]


@pytest.mark.parametrize("fn", [mixedad.mixed_grad, double_backward_mixed_grad])
@pytest.mark.parametrize("create_graph", [False, True])
def test_generator_and_inputs_untouched(fn, create_graph):
    G = zoo.dcgan(latent_dim=6, channels=4, image_size=8, seed=3, dtype=F64)
    # A mix of frozen and trainable parameters, and a half-train, half-eval module tree.
    G[1].weight.requires_grad_(False)
    G[-2].train()
    G[-2].weight.grad = torch.ones_like(G[-2].weight)
    z = torch.randn(2, 6, dtype=F64, requires_grad=True)
    y_trainable = torch.randn(2, 3, 8, 8, dtype=F64, requires_grad=True)
    y_trainable.grad = torch.full_like(y_trainable, 7.0)
    y_frozen = torch.randn(3, 8, 8, dtype=F64)
    y_values = (y_trainable.detach().clone(), y_frozen.clone())
    before = snapshot(G)
    rng = torch.get_rng_state()

    def f(y, g):
        return ((y[0] + g) ** 3).sum() + (y[1] * g).sum()

    fn(f, G, z, (y_trainable, y_frozen), create_graph=create_graph)

    assert_same(before, snapshot(G))
    assert torch.equal(torch.get_rng_state(), rng)
    assert z.requires_grad and z.grad is None
    assert y_trainable.requires_grad and not y_frozen.requires_grad
    assert torch.equal(y_trainable.grad, torch.full_like(y_trainable, 7.0))
    assert y_frozen.grad is None
    assert torch.equal(y_trainable.detach(), y_values[0]) and torch.equal(y_frozen, y_values[1])


def test_mixed_grad_builds_no_graph_through_G():
    """With create_graph=True the result's graph reaches y but no parameter of G."""
    G = zoo.mlp(3, 8, seed=4, dtype=F64)
    z = torch.randn(4, 8, dtype=F64)
    y = torch.randn(4, 8, dtype=F64, requires_grad=True)
    result = mixedad.mixed_grad(lambda y, g: ((y + g) ** 3).sum(), G, z, y, create_graph=True)
    params = list(G.parameters())
    grads = torch.autograd.grad(result.sum(), [y] + params, allow_unused=True)
    assert grads[0] is not None
    assert all(g is None for g in grads[1:])


class Counter(nn.Module):
    """Scales by 1 + n / 10, then bumps its step counter n: in place, or by replacing the buffer."""

    def __init__(self, *, reassign, size=()):
        super().__init__()
        self.reassign = reassign
        self.register_buffer("n", torch.zeros(size, dtype=F64))

    def forward(self, x):
        out = torch.tanh(x) * (1 + self.n.mean() / 10)
        if self.reassign:
            self.n = self.n + 1
        else:
            self.n += 1
        return out


def counter_G(mode, reassign, size=()):
    G = nn.Sequential(nn.Linear(4, 4, dtype=F64), Counter(reassign=reassign, size=size), nn.Linear(4, 4, dtype=F64))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for p in G.parameters():
            nn.init.normal_(p)
    return G.train(mode == "train")


def counter_of(G):
    return G[1]


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# (module mode, replace the buffer object instead of writing into it)
COUNTER_CASES = [("eval", False), ("eval", True), ("train", False), ("train", True)]
CUBIC = lambda y, g: ((y + g) ** 3).sum()  # noqa: E731


@pytest.mark.parametrize("mode, reassign", COUNTER_CASES)
@pytest.mark.parametrize("wrap", [False, True], ids=["module", "function"])
def test_snapshot_restores_a_counter(mode, reassign, wrap):
    G = counter_G(mode, reassign)
    original = counter_of(G).n
    call = (lambda x: G(x)) if wrap else G  # a function's modules are recorded as they run
    snap = Snapshot(call)
    with snap.watching():
        call(torch.ones(2, 4, dtype=F64))
        call(torch.ones(2, 4, dtype=F64))
    assert counter_of(G).n.item() == 2
    for _ in range(2):  # restoring twice is restoring once
        snap.restore()
        assert counter_of(G).n is original, "the original buffer object is back under its name"
        assert counter_of(G).n.item() == 0
        assert "n" in dict(counter_of(G).named_buffers())


def test_unchanged_eval_buffers_are_not_written():
    """An eval BatchNorm's statistics, saved by a graph of the caller's, stay valid through input_grad."""
    G = nn.Sequential(nn.Linear(4, 4, dtype=F64), nn.BatchNorm1d(4, dtype=F64), nn.Tanh()).eval()
    z = randn(6, 4, seed=1)
    pending = G(z.requires_grad_()).pow(2).sum()  # batch_norm saves running_mean and running_var
    versions = [b._version for b in G.buffers()]
    y = randn(4, seed=2).requires_grad_()
    mixedad.input_grad(CUBIC, G, z.detach(), y, chunk_size=2).pow(2).sum().backward()
    assert [b._version for b in G.buffers()] == versions
    pending.backward()


@pytest.mark.parametrize("mode, reassign", COUNTER_CASES)
def test_input_grad_replays_a_counter_as_the_naive_code_runs_it(mode, reassign):
    """Each chunk's replay sees the count its forward saw; the counter ends where the naive code leaves it."""
    z, y0, x = randn(5, 4, seed=1), randn(4, seed=2), randn(4, seed=3)
    results = {}
    for name, fn in [("mixedad", mixedad.input_grad), ("naive", double_backward_input_grad)]:
        G = counter_G(mode, reassign)
        y = y0.clone().requires_grad_()
        dfdz = fn(CUBIC, G, z, y, chunk_size=2)  # 3 chunks: 2 + 2 + 1 codes
        (torch.sin(dfdz @ x) ** 2).sum().backward()
        results[name] = (dfdz.detach(), y.grad, counter_of(G).n.item())
    assert_close(results["mixedad"][0], results["naive"][0], what="dfdz")
    assert_close(results["mixedad"][1], results["naive"][1], what="y.grad")
    assert results["mixedad"][2] == results["naive"][2] == 3


@pytest.mark.parametrize("mode, reassign", COUNTER_CASES)
def test_mixed_grad_matches_the_naive_code_and_counts_one_forward(mode, reassign):
    z, y = randn(3, 4, seed=1), randn(3, 4, seed=2)
    G, G_naive = counter_G(mode, reassign), counter_G(mode, reassign)
    assert_close(mixedad.mixed_grad(CUBIC, G, z, y), double_backward_mixed_grad(CUBIC, G_naive, z, y))
    assert counter_of(G).n.item() == counter_of(G_naive).n.item() == 1


# (call, the count it leaves): mixed_grad as one plain forward of G; the checks and the report
# promise to leave G as it was; cached_backward as the naive loop over 5 inputs.
COUNTING_CALLS = [
    (lambda G, z, y: mixedad.mixed_grad(CUBIC, G, z, y), 1),
    (lambda G, z, y: mixedad.tangent_report(G, z), 0),
    (lambda G, z, y: mixedad.testing.spot_check(CUBIC, G, z, y, stream=io.StringIO()), 0),
    (lambda G, z, y: mixedad.testing.check_generator(G, z), 0),
    (lambda G, z, y: mixedad.cached_backward(G, list(z), lambda Z: Z.sin().sum(), chunk_size=2), 5),
]


@pytest.mark.parametrize("mode, reassign", COUNTER_CASES)
@pytest.mark.parametrize("call, count", COUNTING_CALLS,
                         ids=["mixed_grad", "tangent_report", "spot_check", "check_generator", "cached_backward"])
def test_a_counter_ends_where_the_contract_says(call, count, mode, reassign):
    G = counter_G(mode, reassign)
    original = counter_of(G).n
    call(G, randn(5, 4, seed=1), randn(5, 4, seed=2))
    assert counter_of(G).n.item() == count
    if count == 0:
        assert counter_of(G).n is original, "G is left as it was: the same buffer object"


LARGE = (SMALL_BUFFER_BYTES // 8 + 1,)  # one float64 over the size snapshots copy


@pytest.mark.parametrize("run", [
    lambda G, z, y: mixedad.tangent_report(G, z),
    lambda G, z, y: mixedad.input_grad(CUBIC, G, z, y, chunk_size=1).sum().backward(),
], ids=["tangent_report", "input_grad"])
def test_a_large_eval_buffer_changed_in_place_raises(run):
    G = counter_G("eval", reassign=False, size=LARGE)
    z, y = randn(2, 4, seed=1), randn(4, seed=2).requires_grad_()
    with pytest.raises(RuntimeError, match=rf"G changed the buffer Counter.n of a module in eval mode in place.*"
                                           rf"at most {SMALL_BUFFER_BYTES} bytes, and this one holds {8 * LARGE[0]}"):
        run(G, z, y)


def test_a_large_eval_buffer_replaced_is_put_back():
    G = counter_G("eval", reassign=True, size=LARGE)
    original = counter_of(G).n
    mixedad.tangent_report(G, randn(2, 4, seed=1))
    assert counter_of(G).n is original and not original.any()


def test_buffers_built_in_inference_mode_have_no_version_to_watch():
    def build():
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(4, 4, dtype=F64), nn.BatchNorm1d(4, dtype=F64), nn.Tanh()).eval()

    with torch.inference_mode():
        G = build()  # parameters and buffers are inference tensors: double backward cannot run it
    z, y = randn(3, 4, seed=1), randn(3, 4, seed=2)
    assert_close(mixedad.mixed_grad(CUBIC, G, z, y), double_backward_mixed_grad(CUBIC, build(), z, y))
    assert mixedad.tangent_report(G, z).flat
