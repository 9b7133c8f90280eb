"""Ops of other namespaces than aten: ``torch.library.custom_op``, torchvision's C++ ops.

What this relies on in torch (pinned by ``tests/_hooks/test_library_ops.py``): such ops reach a
torch-function mode as ``torch._ops.OpOverload`` (with ``.namespace``) or
``torch._ops.OpOverloadPacket`` (whose ``_qualified_op_name`` is ``"namespace::name"``).
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
