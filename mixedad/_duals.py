"""Dual tensors at mixedad's forward-AD level: the helpers every per-op tangent rule uses.

The rules run for every layer of every pass, so they call the C++ entry points behind
``forward_ad.unpack_dual`` / ``make_dual`` directly: the Python wrappers cost more than a small
layer's arithmetic (they re-read the level and check the environment on every call).
"""
import torch
from torch import nn
from torch.autograd import forward_ad

from mixedad._trees import tree_leaves


def unpack(x):
    """(primal, tangent or None) of the tensor ``x`` at the innermost dual level."""
    return torch._unpack_dual(x, forward_ad._current_level)


def dual(primal, tangent):
    """A dual tensor at the innermost dual level."""
    return torch._VF._make_dual(primal, tangent, level=forward_ad._current_level)


def tangent_of(x):
    """The tangent ``x`` carries at the innermost dual level, or None (also for non-tensors)."""
    # A Parameter never carries a tangent at mixedad's own dual level (only tensors computed
    # from z do), so it is answered without the unpacking call.
    if not isinstance(x, torch.Tensor) or isinstance(x, nn.Parameter) or x.layout != torch.strided:
        return None  # sparse and other layouts cannot carry forward-mode tangents in PyTorch
    return unpack(x)[1]


def any_tangent(tree):
    """Whether any tensor in the pytree ``tree`` (args and kwargs, say) carries a tangent."""
    return any(tangent_of(leaf) is not None for leaf in tree_leaves(tree))
