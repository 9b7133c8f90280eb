"""Seeing inside Python composites of torch, such as ``F.multi_head_attention_forward``.

A ``TorchFunctionMode`` sees a torch function once, at the top: when the mode lets the call
through, the function's body runs with the mode popped, so the ops it calls (``linear`` for the
projections, ``scaled_dot_product_attention``) are invisible to it. For the composites listed
here the mode runs the body itself, with the mode pushed again. The body's own opening check
(``if has_torch_function(...)``) would send the call straight back to the mode, so the body runs
from a copy of the function whose globals answer that check with False; the ops it calls are
unchanged and reach the mode as usual.
"""
import functools
import types

import torch.nn.functional as F

#: Python composites whose inner ops mixedad's modes must see.
COMPOSITES = frozenset({F.multi_head_attention_forward})

_NO_TORCH_FUNCTION = {
    "has_torch_function": lambda *args, **kwargs: False,
    "has_torch_function_unary": lambda *args, **kwargs: False,
    "has_torch_function_variadic": lambda *args, **kwargs: False,
}


@functools.lru_cache(maxsize=None)
def _body(func):
    globals_ = dict(func.__globals__, **_NO_TORCH_FUNCTION)
    body = types.FunctionType(func.__code__, globals_, func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    return body


def run_inside(mode, func, args, kwargs):
    """``func(*args, **kwargs)`` with ``mode`` active for the ops inside it."""
    with mode:
        return _body(func)(*args, **kwargs)
