"""double_vjp: one op's (or G's) tangent by two reverse passes, and its refusals."""
import pytest
import torch
from torch.autograd.function import once_differentiable

from mixedad.op_rules import OpRuleError
from mixedad.op_rules._double_vjp import double_vjp

F64 = torch.float64


def test_equals_the_jacobian_vector_product_at_u_one_and_at_a_given_u():
    x, t = torch.randn(4, dtype=F64, requires_grad=True), torch.randn(4, dtype=F64)
    out = x.sin() * x
    (tangent,) = double_vjp("call", "op", [out], [x], [t])
    expected = (x.cos() * x + x.sin()).detach() * t
    assert torch.allclose(tangent, expected)
    (at_u,) = double_vjp("call", "op", [x.sin() * x], [x], [t], at=[torch.full((4,), 3.0, dtype=F64)])
    assert torch.allclose(at_u, expected)  # a linear backward: any u gives the same


class Once(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.exp()

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.exp()


def test_a_once_differentiable_backward_is_refused_by_name():
    x = torch.randn(3, dtype=F64, requires_grad=True)
    with pytest.raises(OpRuleError, match="Once has no jvp staticmethod and its backward is marked @once_differentiable"):
        double_vjp("call", "Once", [Once.apply(x)], [x], [torch.ones(3, dtype=F64)])
