"""The written formulas (cdist, group_norm on any layout): exact against finite differences and double backward."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixedad
from mixedad.reference import double_backward_mixed_grad, finite_difference_mixed_grad
from mixedad.testing import assert_close


F64 = torch.float64
gen = torch.Generator().manual_seed(0)


def linear_f(y, g):
    """f = <y, g>: mixed_grad is then J_G v itself, so every entry of the tangent is compared."""
    return (y * g).sum()


def jvp_by_double_backward(G, z, v):
    y = torch.ones_like(G(z))
    return double_backward_mixed_grad(linear_f, G, z, y, v)


def jvp_by_mixedad(G, z, v, **kw):
    y = torch.ones_like(G(z))
    return mixedad.mixed_grad(linear_f, G, z, y, v, strategy="forward", **kw)


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0])
@pytest.mark.parametrize("rows", [5, 30])  # <= 25 rows: _cdist_forward; more: _euclidean_dist on p=2
def test_cdist_formula_against_finite_differences(p, rows):
    gen = torch.Generator().manual_seed(rows)  # away from p = 1's kinks, where finite differences are off
    codebook = torch.randn(7, 4, generator=gen, dtype=F64)
    G = lambda z: torch.cdist(z, codebook * z[:7].sum(), p=p)  # noqa: E731
    z, v = torch.randn(rows, 4, generator=gen, dtype=F64), torch.randn(rows, 4, generator=gen, dtype=F64)
    y = torch.randn(rows, 7, generator=gen, dtype=F64)
    f = lambda y, g: (y * g ** 2).sum()  # noqa: E731
    ours = mixedad.mixed_grad(f, G, z, y, v, strategy="forward")
    assert_close(ours, finite_difference_mixed_grad(f, G, z, y, v), rtol=1e-6)
    if p == 2.0 and rows > 25:  # here double backward exists too
        assert_close(ours, double_backward_mixed_grad(f, G, z, y, v))


def test_cdist_batched_both_sides_with_tangents():
    G = lambda z: torch.cdist(z, z[:, :3] * 2)  # noqa: E731
    z, v = torch.randn(2, 30, 4, dtype=F64), torch.randn(2, 30, 4, dtype=F64)
    assert_close(jvp_by_mixedad(G, z, v), jvp_by_double_backward(G, z, v))


@pytest.mark.parametrize("weight_from_z", [False, True])
def test_group_norm_on_channels_last_with_frozen_or_z_dependent_affine(weight_from_z):
    """Frozen affine: the written formula. Affine from z: PyTorch's formula raises, the local rule takes it."""
    conv = nn.Conv2d(8, 8, 3, padding=1).to(F64).to(memory_format=torch.channels_last)
    gamma = torch.randn(8, dtype=F64)

    def G(z):
        x = conv(z.contiguous(memory_format=torch.channels_last))
        weight = gamma * z.mean() if weight_from_z else gamma
        return F.group_norm(x, 4, weight, None)

    z, v = torch.randn(2, 8, 5, 5, dtype=F64), torch.randn(2, 8, 5, 5, dtype=F64)
    assert_close(jvp_by_mixedad(G, z, v), jvp_by_double_backward(G, z, v))
    path = "local double-VJP" if weight_from_z else "written formula"
    assert "torch.nn.functional.group_norm" in mixedad.tangent_report(G, z, v).ops(path)


@pytest.mark.parametrize("convert", [
    lambda t: t.contiguous(memory_format=torch.channels_last),
    lambda t: t.clone(memory_format=torch.channels_last),
    lambda t: t.to(memory_format=torch.channels_last),
], ids=["contiguous", "clone", "to"])
def test_memory_format_conversions_take_the_rule_with_one_tangent_and_with_a_batch(convert):
    """torch.func cannot batch PyTorch's formula for these; the rule gives the same tangent both ways."""
    from mixedad._frontend.batched import push_tangents
    from mixedad._frontend.tangents import push_tangent
    from mixedad.op_rules import PathRecorder

    gen = torch.Generator().manual_seed(0)
    x, vs = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64), torch.randn(3, 2, 3, 4, 5, generator=gen,
                                                                                    dtype=torch.float64)
    G = lambda t: convert(t * 2.0).sin()  # noqa: E731
    one, batched = PathRecorder(), PathRecorder()
    loop = torch.stack([push_tangent("test", G, [x], [v], recorder=one)[1][0] for v in vs])
    _, tangents, _ = push_tangents("test", G, [x], [vs], recorder=batched)
    assert torch.allclose(tangents[0], loop, rtol=1e-13)
    assert torch.allclose(loop, vs * 2.0 * (x * 2.0).cos(), rtol=1e-13)
    assert {key[1] for key in one.counts} == {key[1] for key in batched.counts} == {"forward AD", "written formula"}
