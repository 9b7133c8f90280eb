"""The autograd node whose backward formula is running, as a dispatch mode sees its ops.

A plan gives some ops the device's behaviour only where a backward formula calls them: group
norm's first-order formula copies its gradient and saved input to contiguous tensors on every
device but the CPU (meta included), and keeps a channels-last one's layout on the CPU
(:mod:`mixedad._planner.layouts`).

What this relies on in torch (pinned by ``tests/_hooks/test_backward_node.py``):
``torch._C._current_autograd_node()`` returns the node whose backward runs on this thread (None
outside a backward), and its ``name()`` is the formula's (``NativeGroupNormBackward0``); on meta,
that formula calls ``aten.clone(memory_format=torch.contiguous_format)`` on a channels-last
gradient and input.
"""
import torch

__all__ = ["running_backward"]


def running_backward():
    """The name of the autograd node whose backward runs on this thread, or None."""
    node = torch._C._current_autograd_node()
    return None if node is None else node.name()
