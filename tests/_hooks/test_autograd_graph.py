"""Pins for mixedad._hooks.autograd_graph: once_differentiable's error node, and aot_autograd's Function name."""
import torch
from torch.autograd.function import once_differentiable

from mixedad._hooks import autograd_graph as hook


class Once(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return g * 2


def test_once_differentiable_leaves_an_error_node_in_the_backwards_graph():
    x, u = torch.randn(3, requires_grad=True), torch.ones(3, requires_grad=True)  # u as double_vjp's
    (g,) = torch.autograd.grad(Once.apply(x), x, grad_outputs=u, create_graph=True)
    assert hook.once_differentiable_node([g]) in ("Error", "DelayedError")
    (plain,) = torch.autograd.grad(x * 2, x, grad_outputs=u, create_graph=True)
    assert hook.once_differentiable_node([plain]) is None


def test_aot_autograds_function_is_named_compiled_function():
    """Read from the source: importing aot_autograd's runtime wrappers alone is not supported."""
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("torch._functorch._aot_autograd.runtime_wrappers")
    assert "class CompiledFunction(torch.autograd.Function)" in pathlib.Path(spec.origin).read_text()
