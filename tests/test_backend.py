"""The reverse-mode back end: f's second order contracted with the tangent, and input_grad's reverse pass."""
import pytest
import torch
from torch import nn

from mixedad import _backend, zoo
from mixedad.reference import double_backward_mixed_grad
from mixedad.testing import assert_close

F64 = torch.float64


def f(y, g):
    return ((y + g) ** 3).sum()


def test_contracting_f_with_a_tangent_is_the_mixed_derivative():
    G = zoo.mlp(2, 4, dtype=F64)
    z, y, v = (torch.randn(3, 4, dtype=F64) for _ in range(3))
    g = G(z).detach()
    tangent = torch.func.jvp(G, (z,), (v,))[1].detach()
    (ours,) = _backend.contract_f_with_tangent("call", f, [y], torch.utils._pytree.tree_flatten(y)[1], [g], [tangent],
                                               torch.utils._pytree.tree_flatten(g)[1], create_graph=False)
    assert_close(ours, double_backward_mixed_grad(f, G, z, y, v))


def test_gradient_chunk_is_df_dz_with_y_constant():
    G = zoo.mlp(2, 4, dtype=F64)
    z, y = torch.randn(3, 4, dtype=F64), torch.randn(4, dtype=F64)
    leaves, spec = torch.utils._pytree.tree_flatten(y)
    (piece,), _ = _backend.gradient_chunk("call", f, G, [z], leaves, spec)
    zz = z.clone().requires_grad_()
    (expected,) = torch.autograd.grad(f(y, G(zz)), zz)
    assert_close(piece, expected)


def test_an_f_that_is_not_a_sum_over_codes_is_refused():
    y = torch.randn(4, dtype=F64)
    leaves, spec = torch.utils._pytree.tree_flatten(y)
    g1, g2 = torch.randn(2, 4, dtype=F64), torch.randn(2, 4, dtype=F64)
    mean_f = lambda y, g: (y * g).mean()  # noqa: E731
    first = ([g1], torch.utils._pytree.tree_flatten(g1)[1], mean_f(y, g1))
    second = ([g2], None, mean_f(y, g2))
    with pytest.raises(ValueError, match="f is not a sum over latent codes"):
        _backend.check_sum_over_codes("call", mean_f, leaves, spec, first, second)
    sum_f = lambda y, g: (y * g).sum()  # noqa: E731
    _backend.check_sum_over_codes("call", sum_f, leaves, spec, ([g1], first[1], sum_f(y, g1)), ([g2], None, sum_f(y, g2)))


def test_frozen_runs_g_on_detached_parameters_and_puts_them_back():
    """No graph through G's parameters, tied weights stay tied inside the call, every parameter object is back after
    it (even when G raises), and no requires_grad flag is touched."""
    from mixedad._entry import frozen

    lin = nn.Linear(3, 3)
    seen = []

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = lin, nn.Linear(3, 3)
            self.b.weight = lin.weight
            self.fail = False

        def forward(self, x):
            seen.append((self.a.weight is self.b.weight, self.a.weight.requires_grad))
            if self.fail:
                raise ValueError("boom")
            return self.b(self.a(x))

    G = Tied()
    before = {name: p for name, p in G.named_parameters()}
    x = torch.randn(2, 3, requires_grad=True)
    out = frozen(G)(x)
    assert seen == [(True, False)] and out.requires_grad
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert all(p.grad is None for p in G.parameters())
    assert {name: p for name, p in G.named_parameters()} == before
    assert all(p.requires_grad for p in G.parameters())
    G.fail = True
    with pytest.raises(ValueError, match="boom"):
        frozen(G)(x)
    assert all(G.get_parameter(name) is p for name, p in before.items())
    assert gx.shape == x.shape
