"""Which tensors an op writes in place, read from the call before it runs.

An op writes in place into:

- its first argument, where it is an in-place method or function (``x.mul_(2)``, ``torch.relu_(x)``,
  ``x.copy_(y)``, ``x[i] = y``, ``x += y``);
- its first argument, where it is called with ``inplace=True`` (``F.relu(x, inplace=True)``, as
  ``nn.ReLU(inplace=True)`` calls it), given by keyword or by position;
- every tensor of its ``out=`` argument.

Methods whose name ends in an underscore but write no values (``requires_grad_``, ``share_memory_``,
``rename_``, ``detach_``) are not writes.
"""
import functools
import inspect

import torch

__all__ = ["in_place_targets", "may_write"]

_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "rename_", "detach_", "retain_grad", "record_stream"})
_AUGMENTED = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                        "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                        "__imatmul__"})


@functools.lru_cache(maxsize=4096)
def _kind(func):
    """``(writes its first argument, position of an ``inplace`` parameter or None)`` for ``func``."""
    name = getattr(func, "__name__", "")
    if name in _AUGMENTED or (name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES):
        return True, None
    try:
        parameters = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return False, None
    return False, parameters.index("inplace") if "inplace" in parameters else None


def in_place_targets(func, args, kwargs):
    """The tensors ``func(*args, **kwargs)`` would write in place (the module docstring); empty if none."""
    try:
        writes_first, inplace_at = _kind(func)
    except TypeError:  # an unhashable callable
        writes_first, inplace_at = False, None
    targets = []
    if not writes_first and inplace_at is not None:
        writes_first = bool(kwargs.get("inplace", args[inplace_at] if len(args) > inplace_at else False))
    if writes_first:
        if args and isinstance(args[0], torch.Tensor):
            targets.append(args[0])
    out = kwargs.get("out") if kwargs else None
    if isinstance(out, torch.Tensor):
        targets.append(out)
    elif isinstance(out, (tuple, list)):
        targets.extend(t for t in out if isinstance(t, torch.Tensor))
    return targets


def may_write(func, kwargs):
    """A quick test before :func:`in_place_targets`: False where ``func`` certainly writes nothing (most ops)."""
    if kwargs and "out" in kwargs:
        return True
    try:
        writes_first, inplace_at = _kind(func)
    except TypeError:  # an unhashable callable
        return True
    return writes_first or inplace_at is not None
