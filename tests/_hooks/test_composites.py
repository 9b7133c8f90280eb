"""Pins for mixedad._hooks.composites: the composites are Python functions with the globals the copy rewrites."""
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

from mixedad._hooks import composites


@pytest.mark.parametrize("func", sorted(composites.COMPOSITES, key=lambda f: f.__name__))
def test_each_composite_is_a_python_function_whose_opening_check_the_copy_rewrites(func):
    assert isinstance(func, types.FunctionType)
    used = set(func.__code__.co_names)
    assert used & set(composites.REWRITTEN), "the opening has_torch_function check the copy answers with False"
    assert all(name in func.__globals__ for name in composites.REWRITTEN if name in used)


def test_a_copy_that_reaches_itself_again_raises_composite_reentered_not_recursion_error():
    func = next(iter(composites.COMPOSITES))

    class Reenters(TorchFunctionMode):
        def __torch_function__(self, f, types, args=(), kwargs=None):
            if f is func:
                return composites.run_inside(self, f, args, kwargs or {})
            return f(*args, **(kwargs or {}))

    mode = Reenters()
    with pytest.raises(composites.CompositeReentered, match="reached itself again"):
        with composites._once(func):
            composites.run_inside(mode, func, (), {})
    q = torch.randn(2, 1, 4)
    with mode:  # a normal call goes through the copy once, and works
        out, _ = torch.nn.functional.multi_head_attention_forward(
            q, q, q, 4, 1, torch.randn(12, 4), None, None, None, False, 0.0, torch.randn(4, 4), None)
    assert out.shape == q.shape
