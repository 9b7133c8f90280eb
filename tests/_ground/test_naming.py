"""How messages name an op: torch functions by their public path, Tensor methods, custom Functions, anything else."""
import torch
import torch.nn.functional as F

from mixedad._ground.naming import op_name


class Scale(torch.autograd.Function):  # a name is all op_name reads of a Function
    forward = staticmethod(lambda ctx, x: 2 * x)


def my_op(x):
    return x


def test_torch_functions_and_methods_by_their_public_names():
    assert op_name(F.linear) == "torch.nn.functional.linear"
    assert op_name(torch.tanh) == "torch.tanh"
    assert op_name(torch.Tensor.add) == "torch.Tensor.add"


def test_a_custom_function_is_named_as_one():
    assert op_name(Scale) == "Scale (custom Function)"


def test_anything_else_by_its_qualified_name_or_repr():
    assert op_name(my_op) == "my_op"
    unnamed = object()
    assert op_name(unnamed) == repr(unnamed)
