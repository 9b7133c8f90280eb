"""Seeing inside Python composites of torch, such as ``F.multi_head_attention_forward``.

A ``TorchFunctionMode`` sees a torch function once, at the top: when the mode lets the call
through, the function's body runs with the mode popped, so the ops it calls (``linear`` for the
projections, ``scaled_dot_product_attention``) are invisible to it. For the composites listed
here the mode runs the body itself, with the mode pushed again. The body's own opening check
(``if has_torch_function(...)``) would send the call straight back to the mode, so the body runs
from a copy of the function whose globals answer that check with False; the ops it calls are
unchanged and reach the mode as usual.

What this relies on in torch (pinned by ``tests/_hooks/test_composites.py``): each composite is
a plain Python function whose module globals include the names in :data:`REWRITTEN`, and which
it uses for its opening check. If a torch version makes the copy reach itself again (the copy
calls the composite by another route), :class:`CompositeReentered` is raised instead of a
RecursionError, and the caller takes another path.
"""
import contextlib
import functools
import threading
import types

import torch.nn.functional as F

#: Python composites whose inner ops mixedad's modes must see.
COMPOSITES = frozenset({F.multi_head_attention_forward})

_NO_TORCH_FUNCTION = {
    "has_torch_function": lambda *args, **kwargs: False,
    "has_torch_function_unary": lambda *args, **kwargs: False,
    "has_torch_function_variadic": lambda *args, **kwargs: False,
}
#: The globals the copy rewrites.
REWRITTEN = tuple(_NO_TORCH_FUNCTION)
_running = threading.local()


class CompositeReentered(RuntimeError):
    """The copy of a composite reached the same composite again through the mode."""


@functools.lru_cache(maxsize=None)
def _body(func):
    globals_ = dict(func.__globals__, **_NO_TORCH_FUNCTION)
    body = types.FunctionType(func.__code__, globals_, func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    return body


@contextlib.contextmanager
def _once(func):
    inside = getattr(_running, "funcs", None)
    if inside is None:
        inside = _running.funcs = set()
    if func in inside:
        raise CompositeReentered(f"{func.__module__}.{func.__qualname__} reached itself again through mixedad's copy")
    inside.add(func)
    try:
        yield
    finally:
        inside.discard(func)


def run_inside(mode, func, args, kwargs):
    """``func(*args, **kwargs)`` with ``mode`` active for the ops inside it."""
    with _once(func), mode:
        return _body(func)(*args, **kwargs)
