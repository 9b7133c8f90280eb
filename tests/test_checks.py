"""Every error branch of mixed_grad and the references: names the argument, expected vs got."""
import pytest
import torch

import mixedad
from mixedad.reference import double_backward_mixed_grad, finite_difference_mixed_grad

F64 = torch.float64


def G(z):
    return torch.tanh(z) * 2


def f(y, g):
    return (y * g ** 2).sum()


Z = torch.randn(5, 8, dtype=F64)
Y = torch.randn(5, 8, dtype=F64)

BAD = [
    # (kwargs overriding f, G, z, y, v, exception, message pattern)
    (dict(f=lambda y, g: y * g), ValueError, r"f\(y, g\) to return a scalar tensor, got shape \(5, 8\)"),
    (dict(f=lambda y, g: 3.0), TypeError, r"f\(y, g\) to return a scalar tensor, got float"),
    (dict(f=lambda y, g: (y * g).sum().long()), TypeError, r"floating-point scalar, got dtype torch.int64"),
    (dict(f="f"), TypeError, r"expected f to be callable .* got str"),
    (dict(G=3), TypeError, r"expected G to be callable .* got int"),
    (dict(z=[1.0, 2.0]), TypeError, r"expected z\[0\] to be a tensor, got float"),
    (dict(z=3.0), TypeError, r"expected z to be a tensor, got float"),
    (dict(z=torch.ones(5, 8, dtype=torch.long)), TypeError, r"expected z to be a real floating-point tensor, got dtype torch.int64"),
    (dict(y=torch.ones(5, 8, dtype=torch.int32)), TypeError, r"expected y to be a real floating-point tensor, got dtype torch.int32"),
    (dict(y={"a": Y, "b": 2.0}), TypeError, r"expected y\['b'\] to be a tensor, got float"),
    (dict(y=()), ValueError, r"expected y to hold at least one tensor"),
    (dict(v=torch.ones(5, 9, dtype=F64)), ValueError, r"v must have z's shape \(5, 8\), got \(5, 9\)"),
    (dict(v=torch.ones(5, 8, dtype=torch.float32)), TypeError, r"v must have z's dtype torch.float64, got torch.float32"),
    (dict(v=torch.ones(5, 8, dtype=F64, device="meta")), ValueError, r"v must be on z's device cpu, got meta"),
    (dict(v=[1.0]), TypeError, r"expected v to be a tensor, got list"),
    (dict(G=lambda z: z.argmax(-1)), TypeError, r"G\(z\) to be a floating-point tensor|floating|differentiable"),
]


@pytest.mark.parametrize("fn, call", [
    (mixedad.mixed_grad, "mixed_grad"),
    (double_backward_mixed_grad, "double_backward_mixed_grad"),
    (finite_difference_mixed_grad, "finite_difference_mixed_grad"),
])
@pytest.mark.parametrize("override, exc, pattern", BAD)
def test_bad_input(fn, call, override, exc, pattern):
    args = dict(f=f, G=G, z=Z, y=Y, v=None)
    args.update(override)
    if fn is not mixedad.mixed_grad and "G" in override and callable(override["G"]):
        pytest.skip("G(z)'s output check belongs to the forward-mode front end")
    with pytest.raises(exc, match=pattern) as info:
        fn(args["f"], args["G"], args["z"], args["y"], args["v"])
    assert str(info.value).startswith(f"{call}(f, G, z, y): ")
