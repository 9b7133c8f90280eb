"""Shapes users have: z as a tuple for G(*z), mismatched devices, f that ignores g."""
import pytest
import torch

import mixedad
from mixedad import zoo
from mixedad.reference import (
    double_backward_input_grad,
    double_backward_mixed_grad,
    finite_difference_mixed_grad,
)
from mixedad.testing import assert_close

F64 = torch.float64


def two_input_generator():
    mlp = zoo.mlp(3, 8, seed=2, dtype=F64)

    def G(code, style):
        return {"image": mlp(torch.cat([code, style], dim=-1)), "style": torch.tanh(style)}

    return G


def f(y, g):
    return ((y + g["image"]) ** 3).sum() + (y[..., :3] * g["style"] ** 2).sum()


def test_tuple_z_mixed_grad_matches_references():
    G = two_input_generator()
    gen = torch.Generator().manual_seed(0)
    code, style, y = (torch.randn(*s, generator=gen, dtype=F64) for s in [(4, 5), (4, 3), (4, 8)])
    v = (torch.randn(4, 5, dtype=F64), torch.randn(4, 3, dtype=F64))
    ours = mixedad.mixed_grad(f, G, (code, style), y, v)
    assert_close(ours, double_backward_mixed_grad(f, G, (code, style), y, v))
    assert_close(ours, finite_difference_mixed_grad(f, G, (code, style), y, v), rtol=1e-6)


def test_tuple_z_input_grad_returns_a_tuple():
    G = two_input_generator()
    code, style = torch.randn(6, 5, dtype=F64), torch.randn(6, 3, dtype=F64)

    def run(make):
        y = torch.randn(8, dtype=F64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        d_code, d_style = make(f, G, (code, style), y, chunk_size=4)
        ((d_code ** 2).sum() * d_style.sum()).backward()
        return d_code.detach(), d_style.detach(), y.grad

    ours = run(mixedad.input_grad)
    assert [t.shape for t in ours[:2]] == [(6, 5), (6, 3)]
    assert_close(ours, run(double_backward_input_grad))


def test_tuple_z_errors():
    G = two_input_generator()
    code, style, y = torch.randn(4, 5, dtype=F64), torch.randn(4, 3, dtype=F64), torch.randn(4, 8, dtype=F64)
    with pytest.raises(TypeError, match=r"expected v to be a tuple of 2 tensors like z, got a torch.float64 tensor"):
        mixedad.mixed_grad(f, G, (code, style), y, code)
    with pytest.raises(ValueError, match=r"v\[1\] must have z\[1\]'s shape \(4, 3\), got \(4, 5\)"):
        mixedad.mixed_grad(f, G, (code, style), y, (code, code))
    with pytest.raises(ValueError, match=r"expected z to hold at least one tensor"):
        mixedad.mixed_grad(f, G, (), y)
    with pytest.raises(ValueError, match=r"same latent codes along dim 0, got leading sizes \[3, 4\]"):
        mixedad.input_grad(f, G, (code, style[:3]), y, chunk_size=2)
    with pytest.raises(TypeError, match=r"mixed_jacobian\(f, G, z, y\): expected z\[1\] to be a real floating-point "
                                        r"tensor, got dtype torch.int64"):
        mixedad.mixed_jacobian(f, G, (code, style.long()), y)


def test_mismatched_devices_are_named():
    G = zoo.mlp(2, 4, dtype=F64)
    z, y = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    with pytest.raises(ValueError, match=r"mixed_grad\(f, G, z, y\): G's 0.weight is on meta but z is on cpu; move G with G.to\('cpu'\)"):
        mixedad.mixed_grad(lambda y, g: (y * g).sum(), zoo.mlp(2, 4, device="meta"), z, y)
    with pytest.raises(ValueError, match=r"input_grad\(f, G, z, y\): y\[1\] is on meta but z is on cpu"):
        mixedad.input_grad(lambda y, g: (y[0] * g).sum(), G, z, (y, torch.ones(4, device="meta")))
    with pytest.raises(ValueError, match=r"expected every z\[i\] on one device, got \['cpu', 'meta'\]"):
        mixedad.mixed_grad(lambda y, g: (y * g).sum(), lambda a, b: a, (z, z.to("meta")), y)


def test_zero_dim_cpu_y_leaf_is_allowed_with_other_devices():
    G = zoo.mlp(2, 4, dtype=F64)
    z, y = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    scale = torch.tensor(2.0, dtype=F64)
    result = mixedad.mixed_grad(lambda y, g: ((y[0] + g) ** 2).sum() * y[1], G, z, (y, scale))
    assert_close(result, double_backward_mixed_grad(lambda y, g: ((y[0] + g) ** 2).sum() * y[1], G, z, (y, scale)))


def test_f_that_ignores_g_gives_zeros_everywhere():
    """Documented: the mixed partial of an f that ignores g is exactly zero (no error)."""
    G = zoo.mlp(2, 4, dtype=F64)
    z, y = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64, requires_grad=True)
    assert torch.equal(mixedad.mixed_grad(lambda y, g: (y ** 3).sum(), G, z, y), torch.zeros_like(y))
    dfdz = mixedad.input_grad(lambda y, g: (y ** 3).sum(), G, z, y)
    assert torch.equal(dfdz, torch.zeros_like(z))
