"""The one restart driver: restarts, refusals, and G's state put back on every way out of a pass."""
import contextlib
import random

import numpy as np
import pytest
import torch
from torch import nn

import mixedad
from mixedad._frontend import restarts
from mixedad._ground.errors import NeedsWholeG, RestartPass
from mixedad._ground.state import Snapshot

D = torch.float64


class Boom(Exception):
    """G's own error."""


class Drawing(nn.Module):
    """A G that updates BatchNorm's statistics and draws from torch's, Python's and NumPy's random states, then
    fails its own way (``fail="G"``) or reaches a tanh whose user rule is broken (``fail="rule"``)."""

    def __init__(self, fail, train=True):
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
        self.fail, self.calls = fail, 0
        self.train(train)

    def forward(self, z):
        h = self.seq(z) * (1 + random.random() + float(np.random.rand()))
        self.calls += 1
        if self.fail == "G":
            raise Boom("G's own error")
        return torch.tanh(h)


def _state(G):
    return (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(), G.seq[1].running_mean.clone(),
            G.seq[1].num_batches_tracked.clone(), G.calls)


def _same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else
               bool(np.array_equal(x, y)) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b))


def f(y, x):
    return ((x - y) ** 2).sum()


gen = torch.Generator().manual_seed(0)
Z, V, Y = (torch.randn(8, 4, dtype=D, generator=gen) for _ in range(3))
VS = torch.randn(3, 8, 4, dtype=D, generator=gen)
CALLS = {
    "mixed_grad": lambda G: mixedad.mixed_grad(f, G, Z, Y, V),
    "mixed_jacobian": lambda G: mixedad.mixed_jacobian(f, G, Z, Y),
    "vmap": lambda G: torch.func.vmap(lambda v: mixedad.mixed_grad(f, G, Z, Y, v))(VS),
    "z_curvature": lambda G: mixedad.z_curvature(f, G, Z, Y, kind="hessian") @ V,
    "compile": lambda G: mixedad.mixed_grad(f, G, Z, Y, V, compile=True),
}


@pytest.fixture
def broken_tanh_rule():
    @mixedad.op_rules.register(torch.tanh)
    def broken(op):
        return "not a pair"

    yield
    mixedad.op_rules.unregister(torch.tanh)


@pytest.mark.filterwarnings("ignore:mixedad.*runs eager:RuntimeWarning")  # compile=True on a G a trace refuses
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_broken_user_rule_leaves_g_and_every_random_source_as_the_call_found_them(call, train, broken_tanh_rule):
    G = Drawing("rule", train).double()
    before = _state(G)
    with pytest.raises(mixedad.op_rules.OpRuleError):  # UnderTransformError under a vmap is one
        CALLS[call](G)
    assert _same(before, _state(G))


@pytest.mark.filterwarnings("ignore:mixedad.*runs eager:RuntimeWarning")
@pytest.mark.parametrize("call", sorted(CALLS))
def test_gs_own_error_leaves_g_and_every_random_source_as_the_call_found_them(call):
    G = Drawing("G", train=False).double()
    before = _state(G)
    with pytest.raises((Boom, mixedad.op_rules.UnderTransformError)):
        CALLS[call](G)
    assert _same(before, _state(G))


def test_input_grads_backward_that_fails_leaves_the_state_its_forward_left(broken_tanh_rule):
    G = Drawing("rule").double()
    y = Y.clone().requires_grad_()
    out = mixedad.input_grad(f, G, Z, y)  # G's forward: it updates and draws, as a plain forward does
    after_forward = _state(G)
    with pytest.raises(mixedad.op_rules.OpRuleError):
        (out * V).sum().backward()
    assert _same(after_forward, _state(G))


class _Snapshot:
    def __init__(self):
        self.restored = 0

    def watching(self, *, mode=True):
        return contextlib.nullcontext()

    def restore(self):
        self.restored += 1


def test_a_restart_runs_the_pass_again_after_putting_g_back():
    attempts, snapshot = [], _Snapshot()

    def attempt():
        attempts.append(1)
        if len(attempts) < 3:
            raise RestartPass("torch.erf", NotImplementedError("no formula"))
        return "done"

    assert restarts.run_restarting(attempt, snapshot, lambda reason, at_cotangent=False: "refused") == "done"
    assert len(attempts) == 3 and snapshot.restored == 2


def test_too_many_restarts_and_what_cannot_go_on_are_refused_with_g_put_back():
    snapshot = _Snapshot()

    def always_restart():
        raise RestartPass("op", NotImplementedError("no formula"))

    refused = restarts.run_restarting(always_restart, snapshot, lambda reason, at_cotangent=False: reason)
    assert refused == f"more than {restarts.MAX_RESTARTS} ops of G needed the local rule in one call"
    assert snapshot.restored == restarts.MAX_RESTARTS + 2

    def needs_whole_g():
        raise NeedsWholeG("G calls torch.autograd.grad inside itself", at_cotangent=True)

    seen = []
    restarts.run_restarting(needs_whole_g, snapshot, lambda reason, at_cotangent=False: seen.append((reason,
                                                                                                      at_cotangent)))
    assert seen == [("G calls torch.autograd.grad inside itself", True)]


def test_a_real_snapshot_restores_buffers_after_an_error_in_the_pass():
    G = Drawing("G").double()
    before = _state(G)
    with pytest.raises(Boom):
        restarts.run_restarting(lambda: G(Z), Snapshot(G), lambda reason, at_cotangent=False: None)
    assert _same(before, _state(G))
