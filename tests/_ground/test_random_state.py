"""Every random source G draws from is replayed, and left where one plain forward leaves it.

Sources: torch's global generator, a ``torch.Generator`` G's ops receive (held by a module, or
closed over), Python's ``random`` and NumPy's global generator. Each is crossed with every call
that runs G more than once; the reference is double backward written here, run from the same
states, in float64.
"""
import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import mixedad
from mixedad._ground import random_state
from mixedad._ground.random_state import RandomState
from mixedad.testing import assert_close

F64 = torch.float64
W = torch.randn(4, 4, dtype=F64, generator=torch.Generator().manual_seed(0)) / 2
GEN = torch.Generator()


class NoisyModule(nn.Module):
    """A layer that draws from a generator it holds."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4).double().requires_grad_(False)  # frozen: the naive code saves no input
        self.gen = torch.Generator().manual_seed(4)

    def forward(self, z):
        h = self.lin(z)
        noise = torch.randn(h.shape, generator=self.gen, dtype=F64)
        return torch.tanh(h + noise) * (1 + 0.1 * noise)


def _noisy(draw):
    def G(z):
        h = z @ W
        noise = draw(h)
        return torch.tanh(h + noise) * (1 + 0.1 * noise)

    return G


#: source -> (G, put every state where the test starts, read the state that must match)
SOURCES = {
    "global": (_noisy(lambda h: torch.randn_like(h)), lambda: torch.manual_seed(1), torch.get_rng_state),
    "generator": (_noisy(lambda h: torch.randn(h.shape, generator=GEN, dtype=F64)), lambda: GEN.manual_seed(2),
                  GEN.get_state),
    "bernoulli": (_noisy(lambda h: torch.bernoulli(torch.full_like(h, 0.5), generator=GEN)), lambda: GEN.manual_seed(2),
                  GEN.get_state),
    "python": (_noisy(lambda h: torch.full_like(h, random.random())), lambda: random.seed(3), random.getstate),
    "numpy": (_noisy(lambda h: torch.as_tensor(np.random.rand(*h.shape), dtype=F64)), lambda: np.random.seed(3),
              lambda: np.random.get_state()[1].copy()),
}


def _module_source():
    G = NoisyModule()
    return G, lambda: G.gen.manual_seed(4), G.gen.get_state


def f(y, g):
    return ((y + g) ** 3).sum()


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, generator=gen, dtype=F64) for _ in range(3)]


def _naive_mixed(G, reset, z, y, v):
    reset()
    z, y = z.clone().requires_grad_(), y.clone().requires_grad_()
    (dz,) = torch.autograd.grad(f(y, G(z)), z, create_graph=True)
    return torch.autograd.grad((dz * v).sum(), y)[0]


def _sources():
    cases = [pytest.param(G, reset, read, id=name) for name, (G, reset, read) in SOURCES.items()]
    return cases + [pytest.param(*_module_source(), id="module generator")]


@pytest.mark.parametrize("G, reset, read", _sources())
def test_input_grad_backward_replays_every_source_and_leaves_it_as_the_forward(G, reset, read):
    z, y, v = _problem(1)
    y = y[0].clone().requires_grad_()  # shared by the codes, so that f sums over them
    reset()
    d = mixedad.input_grad(f, G, z, y, chunk_size=2)
    after_forward = read()
    (ours,) = torch.autograd.grad((d * v).sum(), y)
    assert _same(read(), after_forward)  # the backward's replays are undone
    reset()
    expected = 0
    for c in (slice(0, 2), slice(2, 3)):  # chunk by chunk, each from the state its forward saw
        zc = z[c].clone().requires_grad_()
        yc = y.detach().clone().requires_grad_()
        (dz,) = torch.autograd.grad(f(yc, G(zc)), zc, create_graph=True)
        expected = expected + torch.autograd.grad((dz * v[c]).sum(), yc)[0]
    assert _same(read(), after_forward)
    assert_close(ours, expected, rtol=1e-10)


@pytest.mark.parametrize("G, reset, read", _sources())
def test_mixed_jacobian_chunks_and_z_curvature_replay_every_source(G, reset, read):
    z, y, v = _problem(2)
    reset()
    J = mixedad.mixed_jacobian(f, G, z, y, chunk_size=5)
    after = read()
    reset()
    G(z)
    assert _same(read(), after)  # as one plain forward leaves it
    reset()
    zz, yy = z.clone().requires_grad_(), y.clone().requires_grad_()
    (dz,) = torch.autograd.grad(f(yy, G(zz)), zz, create_graph=True)
    rows = [torch.autograd.grad(dz.reshape(-1)[i], yy, retain_graph=True)[0] for i in range(z.numel())]
    assert_close(J, torch.stack(rows).reshape(*z.shape, *y.shape), rtol=1e-10)

    reset()
    op = mixedad.z_curvature(f, G, z, y, kind="hessian")
    ours = op @ v
    reset()
    zz = z.clone().requires_grad_()
    (dz,) = torch.autograd.grad(f(y, G(zz)), zz, create_graph=True)
    assert_close(ours, torch.autograd.grad((dz * v).sum(), zz)[0], rtol=1e-10)


@pytest.mark.parametrize("G, reset, read", _sources())
def test_restarts_and_the_whole_g_fallback_replay_every_source(G, reset, read):
    z, y, v = _problem(3)

    def writes_its_input(q):  # the pass restarts on copies of z and v at the in-place write, after G drew
        h = G(q)
        q.mul_(1.0)
        return h

    def hooked(q):  # a gradient hook: all of G takes the whole-G fallback, after a forward pass that drew
        h = G(q)
        h.register_hook(lambda g: g)
        return h

    for G2 in (writes_its_input, hooked):
        reset()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "mixedad: G registers a gradient hook", RuntimeWarning)  # said once
            ours = mixedad.mixed_grad(f, G2, z, y, v)
        after = read()
        reset()
        G2(z.clone().requires_grad_() if G2 is hooked else z.clone())
        assert _same(read(), after)
        assert_close(ours, _naive_mixed(lambda q: G2(q.clone()), reset, z, y, v), rtol=1e-10)


def test_compile_never_bakes_a_host_side_draw_it_runs_eagerly_and_says_why():
    class Host(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4).double()

        def forward(self, z):
            return torch.tanh(self.lin(z) * (1 + 0.1 * random.random() + 0.1 * float(np.random.rand())))

    G = Host()
    z, y, v = _problem(4)
    with pytest.warns(RuntimeWarning, match=r"with compile=True runs eager .*G draws random numbers \(Python's random, "
                                            r"NumPy's global generator\)"):
        for seed in range(3):
            random.seed(seed), np.random.seed(seed)
            ours = mixedad.mixed_grad(f, G, z, y, v, compile=True)
            after = (random.getstate(), np.random.get_state()[1].copy())
            random.seed(seed), np.random.seed(seed)
            expected = mixedad.reference.double_backward_mixed_grad(f, G, z, y, v)
            assert after[0] == random.getstate() and np.array_equal(after[1], np.random.get_state()[1])
            assert_close(ours, expected, rtol=1e-10)
    assert all(entry.status == "eager" for entry in mixedad.programs.compiled_tangents(G))


def test_a_random_state_holds_every_source_and_restores_them_all():
    gen, other = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)

    def G(z):  # a G whose generator is known from its first watched pass
        return z * torch.randn(3, generator=gen)

    with random_state.watching(RandomState(G)):
        G(torch.ones(3))  # first seen here: its state before this draw is recorded, and remembered for G
    with random_state.watching(RandomState()):
        torch.randn(3, generator=other)  # seen for no G: not captured up front by G's states
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(), gen.get_state())
    state = RandomState(G)  # a generator seen before for G is captured up front
    assert gen in state.generators and other not in state.generators and state.is_current()
    torch.randn(2), random.random(), np.random.rand(), torch.randn(2, generator=gen)
    assert state.drawn() == ["torch's global generator", "Python's random", "NumPy's global generator",
                             "a torch.Generator"]
    state.restore()
    assert state.is_current()
    after = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1], gen.get_state())
    assert all(_same(a, b) for a, b in zip(before, after))
