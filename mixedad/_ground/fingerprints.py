"""How mixedad records a value for a later comparison: by value where it is simple, by contents where it is a
container or a plain object, by identity (and version, for a tensor) otherwise; a module class by its attributes
and the globals its ``forward`` names.

The key of a tangent program (:mod:`mixedad._programs.key`) and the structure records a saved pass checks
(:mod:`mixedad._ground.structure`) are both made of these.
"""
import types
from typing import Any, Dict

import torch
from torch import nn

__all__ = ["SIMPLE_TYPES", "class_key", "fingerprint", "forward_globals", "own_attributes", "own_classes"]

_SIMPLE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
SIMPLE_TYPES = frozenset(_SIMPLE)


def fingerprint(value, held, depth=3, live=False):
    """A value as the key sees it: simple values by value, containers and plain objects by their contents
    (``depth`` levels down), tensors, modules and functions by identity. What is keyed by identity goes
    into ``held``, which the cache entry keeps: an object it keys stays alive, so its id is never reused.
    A tensor also by its version counter, unless ``live`` (parameters and buffers, which a program reads
    when it runs): traced code computes with other tensors when it is written, and keeps the result."""
    kind = type(value)
    if kind in SIMPLE_TYPES:  # the common cases first: the key is computed on every call
        return value
    if kind is tuple and all(type(v) in SIMPLE_TYPES for v in value):
        return tuple, value
    if isinstance(value, _SIMPLE):
        return value
    if depth and isinstance(value, (tuple, list)):
        return type(value), tuple(fingerprint(v, held, depth - 1) for v in value)
    if depth and isinstance(value, dict):
        return dict, tuple((k if isinstance(k, _SIMPLE) else fingerprint(k, held, 0), fingerprint(v, held, depth - 1))
                           for k, v in value.items())
    if (depth and not isinstance(value, (torch.Tensor, nn.Module, type, types.ModuleType)) and not callable(value)
            and isinstance(getattr(value, "__dict__", None), dict)):
        return type(value), fingerprint(vars(value), held, depth - 1)  # a config object, a namespace
    held.append(value)
    if isinstance(value, torch.Tensor):
        if live or value.is_inference():
            return id(value), value.dtype, value.device
        return id(value), value.dtype, value.device, value._version
    return id(value), type(value)


_GLOBALS: Dict[type, Any] = {}


def own_classes(cls):
    """A module class and its bases up to ``nn.Module``, in MRO order."""
    return [c for c in cls.__mro__ if c not in nn.Module.__mro__]


def own_attributes(cls):
    """``(name, value)`` of each attribute of a module class and of its bases up to ``nn.Module``, in that order,
    dunder names left out (what Python keeps on a class, such as the ``__slotnames__`` cache)."""
    return tuple((n, v) for c in own_classes(cls) for n, v in vars(c).items() if not n.startswith("__"))


def forward_globals(cls):
    """``(globals, names)``: the module globals a class's ``forward`` runs in, and the names its code reads from
    them (remembered per class)."""
    names = _GLOBALS.get(cls)
    if names is None:
        forward = getattr(cls.forward, "__code__", None)
        glob = getattr(cls.forward, "__globals__", {})
        names = _GLOBALS[cls] = (glob, tuple(n for n in forward.co_names if n in glob) if forward else ())
    return names


def class_key(cls, held, namespaces=None, globals_read=None):
    """The attributes of a module class and its bases up to ``nn.Module`` (``scale = 2.0`` in the class body),
    and the globals its ``forward`` names (``SCALE`` in ``x * SCALE``); from ``namespaces`` (the dicts of those
    classes) and ``globals_read`` (those globals' values) where given, recorded before."""
    if namespaces is None:
        namespaces = [vars(c) for c in own_classes(cls)]
    if globals_read is None:
        glob, used = forward_globals(cls)
        globals_read = [glob.get(n) for n in used]
    return (cls, tuple(fingerprint(v, held) for v in globals_read),
            tuple((n, fingerprint(v, held)) for namespace in namespaces for n, v in namespace.items()
                  if not n.startswith("__")))
