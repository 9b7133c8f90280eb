"""Ops of other namespaces than aten: ``torch.library.custom_op``, torchvision's C++ ops.

What this relies on in torch (pinned by ``tests/_hooks/test_library_ops.py``): such ops reach a
torch-function mode as ``torch._ops.OpOverload`` (with ``.namespace`` and ``._schema.arguments``)
or ``torch._ops.OpOverloadPacket`` (whose ``_qualified_op_name`` is ``"namespace::name"``, and
whose ``overloads()`` name its ``OpOverload`` attributes).
"""
import torch

_CORE = ("aten", "prim", "prims")


def is_library_op(func):
    """Whether ``func`` is an op of a library namespace (not aten or prims)."""
    if isinstance(func, torch._ops.OpOverload):
        namespace = func.namespace
    elif isinstance(func, torch._ops.OpOverloadPacket):  # its .namespace would look for an overload
        namespace = func._qualified_op_name.split("::")[0]
    else:
        return False
    return namespace not in _CORE


def registry_keys(op):
    """The ops a rule for ``op`` is registered under: a packet's overloads too."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [op, *(getattr(op, name) for name in op.overloads())]
    return [op]


def schema_argument_names(op):
    """The argument names in ``op``'s schema (a packet: its default overload's), or None without one."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        op = getattr(op, "default", None)
    schema = getattr(op, "_schema", None)
    return None if schema is None else tuple(a.name for a in schema.arguments)
