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
from typing import Any, List

import torch

from mixedad._ground.fingerprints import SIMPLE_TYPES, class_key, fingerprint
from mixedad._hooks.module_hooks import MODULE_INTERNALS as _MODULE_INTERNALS
from mixedad._hooks.module_hooks import global_hook_handles, hook_handles
from mixedad.op_rules._user import generation

__all__ = ["key_of"]

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


def key_of(G, zs, vs, batch):
    """``(key, held)``: what a program is written for (the inputs' layouts; G's modules with their modes,
    hooks, tensors and attributes; their classes' attributes and the globals their forwards name: a program
    reads such values as they were when it was written; the process's module hooks), and the objects the
    key identifies by id. A hook added after a program was written gives another key, whose program is
    refused (a program never runs hooks).

    The key is one flat tuple (its runs of varying length ended by a private marker): it is computed, hashed and
    compared on every call that may take a program, and a flat tuple is quicker to build and look up than nested
    ones."""
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
