"""A G that writes its input in place writes mixedad's copy: the caller's z and v are never written.

Each case is a G that writes into its input (an in-place method, a write into a view, an in-place
layer first in an ``nn.Sequential``, a custom Function that marks its input dirty) crossed with the
calls that run it. The reference is double backward written here, on a copy of z (autograd refuses a
write into a leaf that requires grad, so naive code clones it), in float64.
"""
import pytest
import torch
from torch import nn

import mixedad
from mixedad.testing import assert_close

F64 = torch.float64
W = torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(0))


class DoubleDirty(torch.autograd.Function):
    """Doubles its input in place (ctx.mark_dirty), no jvp: the local rule takes it."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class DoubleDirtyJvp(DoubleDirty):
    """The same with its own jvp, which writes the tangent in place as forward AD asks."""

    @staticmethod
    def jvp(ctx, t):
        return t.mul_(2)


def _view_written(q):
    q[:, 0].mul_(3.0)
    return torch.tanh(q @ W)


GENERATORS = {
    "method": lambda: (lambda q: torch.tanh(q.mul_(2.0) @ W)),
    "view": lambda: _view_written,
    "relu first": lambda: nn.Sequential(nn.ReLU(inplace=True), nn.Linear(3, 4, dtype=F64), nn.Tanh()),
    "leaky relu first": lambda: nn.Sequential(nn.LeakyReLU(0.1, inplace=True), nn.Linear(3, 4, dtype=F64)),
    "function": lambda: (lambda q: torch.tanh(DoubleDirty.apply(q) @ W)),
    "function with jvp": lambda: (lambda q: torch.tanh(DoubleDirtyJvp.apply(q) @ W)),
}


def f(y, g):
    return ((y + g) ** 3).sum()


def _naive_mixed(G, z, y, v):
    base, yy = z.detach().clone().requires_grad_(), y.clone().requires_grad_()
    (dz,) = torch.autograd.grad(f(yy, G(base.clone())), base, create_graph=True)
    return torch.autograd.grad((dz * v).sum(), yy)[0]


def _problem(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=gen, dtype=F64) for _ in range(2)] + [torch.randn(4, 4, generator=gen,
                                                                                          dtype=F64)]


@pytest.mark.parametrize("name", GENERATORS)
def test_mixed_grad_vmap_and_mixed_jacobian_leave_z_and_v_as_they_were(name):
    G = GENERATORS[name]()
    z, v, y = _problem(1)
    z0, v0 = z.clone(), v.clone()
    expected = _naive_mixed(G, z, y, v)
    for _ in range(4):  # an nn.Sequential's third call would take a tangent program
        assert_close(mixedad.mixed_grad(f, G, z, y, v), expected, rtol=1e-10)
    assert torch.equal(z, z0) and torch.equal(v, v0)
    V = torch.stack([v, 2 * v])
    batched = torch.func.vmap(lambda t: mixedad.mixed_grad(f, G, z, y, t))(V)
    assert_close(batched[1], 2 * expected, rtol=1e-10)
    jac = mixedad.mixed_jacobian(f, G, z, y, chunk_size=5)
    assert_close(torch.tensordot(v, jac, dims=2), expected, rtol=1e-10)
    assert torch.equal(z, z0) and torch.equal(V, torch.stack([v0, 2 * v0]))
    if isinstance(G, nn.Module):
        assert mixedad.tangent_report(G, z, v).route == "per-op pass"  # never a program: it would write z and v


@pytest.mark.parametrize("name", ["method", "view", "relu first", "function"])
def test_input_grad_and_z_curvature_hand_g_a_copy(name):
    G = GENERATORS[name]()
    z, u, y = _problem(2)
    y = y[0].clone().requires_grad_()
    z0 = z.clone()
    d = mixedad.input_grad(f, G, z, y, chunk_size=2)
    (ours,) = torch.autograd.grad((d * u).sum(), y)
    expected = sum(_naive_mixed(G, z[c], y.detach(), u[c]) for c in (slice(0, 2), slice(2, 4)))
    assert_close(ours, expected, rtol=1e-10)
    op = mixedad.z_curvature(f, G, z, y.detach(), kind="hessian")
    base = z.detach().clone().requires_grad_()
    (dz,) = torch.autograd.grad(f(y.detach(), G(base.clone())), base, create_graph=True)
    assert_close(op @ u, torch.autograd.grad((dz * u).sum(), base)[0], rtol=1e-10)
    assert torch.equal(z, z0)


def _sigmoid_relu(inplace):
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(3, 6, dtype=F64), nn.Sigmoid(), nn.ReLU(inplace=inplace), nn.Linear(6, 4, dtype=F64))


#: G that overwrites a value its own backward saved, and the same G out of place. Double backward refuses the
#: first ("modified by an inplace operation"); forward mode saves nothing, and gives the second's derivative.
OVERWRITES = {
    "tanh output scaled in place": (lambda q: torch.tanh(q @ W).mul_(2.0), lambda q: torch.tanh(q @ W).mul(2.0)),
    "z read, then written": (lambda q: (q * q).sum(1, keepdim=True) * q.copy_(q.sin()) @ W,
                             lambda q: (q * q).sum(1, keepdim=True) * q.sin() @ W),
    "sigmoid then ReLU(inplace=True)": (_sigmoid_relu(True), _sigmoid_relu(False)),
}


@pytest.mark.parametrize("name", OVERWRITES)
def test_where_double_backward_refuses_an_overwritten_saved_value_mixedad_gives_the_out_of_place_derivative(name):
    G, out_of_place = OVERWRITES[name]
    z, v, y = _problem(3)
    expected = mixedad.reference.double_backward_mixed_grad(f, out_of_place, z, y, v)
    for _ in range(3):
        assert_close(mixedad.mixed_grad(f, G, z, y, v), expected, rtol=1e-10)
    jac = mixedad.mixed_jacobian(f, G, z, y, chunk_size=5)
    assert_close(torch.tensordot(v, jac, dims=2), expected, rtol=1e-10)
