"""``torch.no_grad()`` regions inside G: constants, as in reverse mode.

Forward-mode AD ignores ``no_grad`` (documented upstream): a tangent flows through a
``with torch.no_grad():`` block inside G, while double backward treats the block's results as
constants. mixedad follows reverse mode. While its forward pass runs G in a thread,
```torch.no_grad``'s ``__enter__`` and ``__exit__`` are routed here (the class attributes are
replaced while at least one pass needs them, and restored afterwards; other threads see the
original behaviour). Inside a region, :class:`StripTangents` hands every torch function the
primals of its arguments (detached: this holds for dual tensors and for ``torch.func.jvp``'s
tensors under ``vmap`` alike, so ``mixed_jacobian`` is covered too), so what the region computes
carries no tangent, and custom Functions run on primals (see :func:`inside_region`). The decorator form, ``@torch.no_grad()``, goes
through the same methods, and so does ``with torch.set_grad_enabled(False):``. Not tracked:
``torch.set_grad_enabled(False)`` called as a plain function (no ``with``), and
``torch.enable_grad()`` nested inside a region (the region stays constant).
"""
import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from mixedad._trees import tree_map

_no_grad = torch.autograd.grad_mode.no_grad
_set_grad_enabled = torch.autograd.grad_mode.set_grad_enabled
_ORIGINAL_ENTER, _ORIGINAL_EXIT = _no_grad.__enter__, _no_grad.__exit__
_ORIGINAL_SET_ENTER, _ORIGINAL_SET_EXIT = _set_grad_enabled.__enter__, _set_grad_enabled.__exit__
_local = threading.local()
_lock = threading.Lock()
_users = 0


def primals(tree):
    """``tree`` with every tensor detached: dual tensors and torch.func's wrapped tensors lose
    their tangents (``detach`` is stop-gradient in forward AD and in torch.func alike)."""
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


class StripTangents(TorchFunctionMode):
    """Torch functions see primals only: their results carry no tangent."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = primals((args, kwargs or {}))
        return func(*args, **kwargs)


def inside_region():
    """Whether this thread is inside a ``torch.no_grad()`` region of G during a mixedad pass."""
    return any(mode is not None for mode in getattr(_local, "regions", None) or ())


def _open_region(regions, constant):
    """Push a mode for a region: StripTangents for a no-grad region, None (a marker) otherwise."""
    mode = StripTangents() if constant else None
    if mode is not None:
        mode.__enter__()
    regions.append(mode)


def _close_region(regions, exc):
    mode = regions.pop()
    if mode is not None:
        mode.__exit__(*exc)


def _enter(self):
    _ORIGINAL_ENTER(self)
    regions = getattr(_local, "regions", None)
    if regions is not None:
        _open_region(regions, True)


def _exit(self, *exc):
    regions = getattr(_local, "regions", None)
    if regions:
        _close_region(regions, exc)
    _ORIGINAL_EXIT(self, *exc)


def _set_enter(self):
    _ORIGINAL_SET_ENTER(self)
    regions = getattr(_local, "regions", None)
    if regions is not None:
        _open_region(regions, not self.mode)  # with torch.set_grad_enabled(False): a constant


def _set_exit(self, *exc):
    regions = getattr(_local, "regions", None)
    if regions:
        _close_region(regions, exc)
    _ORIGINAL_SET_EXIT(self, *exc)


@contextlib.contextmanager
def tracking():
    """Treat ``torch.no_grad()`` regions that G opens in this thread as constants."""
    global _users
    with _lock:
        if _users == 0:
            _no_grad.__enter__, _no_grad.__exit__ = _enter, _exit
            _set_grad_enabled.__enter__, _set_grad_enabled.__exit__ = _set_enter, _set_exit
        _users += 1
    previous = getattr(_local, "regions", None)
    _local.regions = []
    try:
        yield
    finally:
        _local.regions = previous
        with _lock:
            _users -= 1
            if _users == 0:
                _no_grad.__enter__, _no_grad.__exit__ = _ORIGINAL_ENTER, _ORIGINAL_EXIT
                _set_grad_enabled.__enter__, _set_grad_enabled.__exit__ = _ORIGINAL_SET_ENTER, _ORIGINAL_SET_EXIT
