"""What a tangent program is written for: its key.

A program holds for one set of input shapes, strides, dtypes and devices, one number of tangents
(0: one tangent, k: a batch of k), and G as it is when it is written: which modules, in which
train/eval mode, with which parameters and buffers (by identity and dtype; a program reads their
values when it runs), every other attribute of each module (numbers and strings by value,
containers and config objects by their contents, tensors by identity and version, anything else
by identity), the attributes of each module's class and the globals its ``forward`` names, the
CPU's oneDNN switch, and the users' tangent rules (registering or removing one). A change to any of them gives another key, and another program.

Objects the key identifies by id are returned with it (``held``) and kept alive by the cache
entry, so that an id is never reused by another object while the key is in use. The key is
computed on every call that may take a program, so the common values take the shortest paths.
"""
import types
from typing import Any, Dict, List

import torch
from torch import nn

from mixedad._hooks.module_hooks import MODULE_INTERNALS as _MODULE_INTERNALS
from mixedad._hooks.module_hooks import global_hook_handles, hook_handles
from mixedad.op_rules._user import generation

__all__ = ["SIMPLE_TYPES", "class_key", "fingerprint", "forward_globals", "key_of", "own_attributes", "own_classes"]

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


#: Ends each run of a flat key whose length varies (a module's parameters, buffers, attributes; the modules): a
#: private object no module holds, so that two flat keys are equal exactly where their runs are.
_END = object()


def _module_key(m, held, root, key):
    """Append module ``m``'s part of the key to the flat list ``key``: its identity and mode, the ids of its hooks by
    kind, its children, its parameters and buffers (identity, dtype, device: a program reads their values live, as
    :func:`fingerprint`'s ``live``) and every other attribute by name, type and :func:`fingerprint`."""
    attributes = m.__dict__
    if m is not root:  # G itself is the cache's weak key: it is not held, and lives while its entries do
        held.append(m)
    key += (id(m), m.training, hook_handles(m))
    children = attributes["_modules"]  # order and repeats
    key += (tuple(children), tuple(map(id, children.values())))
    for tensors in (attributes["_parameters"], attributes["_buffers"]):
        for t in tensors.values():
            if t is None:
                key.append(None)
            else:
                held.append(t)
                key += (id(t), t.dtype, t.device)
        key.append(_END)
    for name, value in attributes.items():
        if name not in _MODULE_INTERNALS:
            kind = type(value)
            key += (name, kind, value if kind in SIMPLE_TYPES else fingerprint(value, held))
    key.append(_END)


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


def key_of(G, zs, vs, batch):
    """``(key, held)``: what a program is written for (the inputs' layouts; G's modules with their modes,
    hooks, tensors and attributes; their classes' attributes and the globals their forwards name: a program
    reads such values as they were when it was written; the process's module hooks), and the objects the
    key identifies by id. A hook added after a program was written gives another key, whose program is
    refused (a program never runs hooks).

    The key is one flat tuple (its runs of varying length ended by a private marker): it is computed, hashed and
    compared on every call that may take a program, and a flat tuple is quicker to build and look up than nested
    ones (225 against 250 us on the speed benchmark's DCGAN)."""
    held: List[Any] = []
    key: List[Any] = [batch, torch.backends.mkldnn.enabled, global_hook_handles(), generation()]
    for t in (*zs, *vs):
        key += (t.shape, t.stride(), t.dtype, t.device)
    key.append(_END)
    modules = list(G.modules())
    for m in modules:
        _module_key(m, held, G, key)
    key.append(_END)
    key.extend(class_key(c, held) for c in sorted({type(m) for m in modules}, key=id))
    return tuple(key), held
