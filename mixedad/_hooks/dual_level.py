"""Dual tensors at mixedad's forward-AD level: the helpers every per-op tangent rule uses.

The rules run for every layer of every pass, so they call the C++ entry points behind
``forward_ad.unpack_dual`` / ``make_dual`` directly: the Python wrappers cost more than a small
layer's arithmetic (they re-read the level and check the environment on every call).

What this relies on in torch (pinned by ``tests/_hooks/test_dual_level.py``):

- ``torch.autograd.forward_ad._current_level`` is the process-wide level (-1 when none is open);
- ``torch._unpack_dual(x, level)`` and ``torch._VF._make_dual(primal, tangent, level=...)`` are
  what ``unpack_dual`` and ``make_dual`` call;
- entering a second ``dual_level()`` raises from ``forward_ad.enter_dual_level`` (PyTorch has one
  level), which :func:`raised_entering_a_dual_level` finds in the traceback.
"""
import torch
from torch import nn
from torch.autograd import forward_ad



def dual_level_open():
    """Whether a forward-AD level is open in the process (the caller's, or a mixedad pass's)."""
    return forward_ad._current_level >= 0


def unpack(x):
    """(primal, tangent or None) of the tensor ``x`` at the innermost dual level."""
    return torch._unpack_dual(x, forward_ad._current_level)


def dual(primal, tangent):
    """A dual tensor at the innermost dual level."""
    return torch._VF._make_dual(primal, tangent, level=forward_ad._current_level)


def split(x):
    """(primal, tangent or None) of a strided tensor ``x``.

    A tensor that TorchScript's interpreter hands over without autograd metadata (a scripted
    module's bias) cannot be unpacked; it carries no tangent.
    """
    try:
        return unpack(x)
    except RuntimeError:
        return x, None


def tangent_of(x):
    """The tangent ``x`` carries at the innermost dual level, or None (also for non-tensors)."""
    # A Parameter never carries a tangent at mixedad's own dual level (only tensors computed
    # from z do), so it is answered without the unpacking call.
    if not isinstance(x, torch.Tensor) or isinstance(x, nn.Parameter) or x.layout != torch.strided:
        return None  # sparse and other layouts cannot carry forward-mode tangents in PyTorch
    return split(x)[1]


def any_tangent(tree, *, tangents=False):
    """Whether any tensor in ``tree`` (args and kwargs, say: tuples, lists and dicts) carries a tangent.

    With ``tangents``, ``tree`` holds tangents already (from :func:`split_tree`): any tensor counts.
    Walked by hand rather than with pytree: the dispatch asks this for every op of every pass.
    """
    if isinstance(tree, torch.Tensor):
        return tangents or tangent_of(tree) is not None
    if isinstance(tree, (list, tuple)):
        return any(any_tangent(leaf, tangents=tangents) for leaf in tree)
    if isinstance(tree, dict):
        return any(any_tangent(leaf, tangents=tangents) for leaf in tree.values())
    return False


def any_tangent_in(args, kwargs):
    """Whether any argument of a call carries a tangent (the dispatch's hot path)."""
    for arg in args:
        if any_tangent(arg):
            return True
    for arg in kwargs.values():
        if any_tangent(arg):
            return True
    return False


_NESTED = (torch.Tensor, list, tuple, dict)


def split_args(args):
    """``(primals, tangents)`` of a call's positional arguments, as lists; see :func:`split_tree`."""
    primals, tangents = [], []
    for arg in args:
        if type(arg) is torch.Tensor and arg.layout == torch.strided:
            primal, tangent = split(arg)
        elif arg is None or isinstance(arg, nn.Parameter):  # a frozen weight, an absent bias
            primal, tangent = arg, None
        elif isinstance(arg, (torch.Tensor, list, tuple, dict)):
            primal, tangent = split_tree(arg)
        else:
            primal, tangent = arg, None
        primals.append(primal)
        tangents.append(tangent)
    return primals, tangents


def split_tree(tree):
    """``(primals, tangents)``: ``tree`` with each strided tensor split, containers rebuilt alike.

    Lists, plain tuples and dicts are walked; anything else is a leaf with no tangent.
    """
    if isinstance(tree, torch.Tensor):
        if isinstance(tree, nn.Parameter) or tree.layout != torch.strided:
            return tree, None
        return split(tree)
    kind = type(tree)
    if kind is list or kind is tuple:
        if not any(isinstance(leaf, _NESTED) for leaf in tree):
            return tree, None  # sizes, strides, paddings: nothing to split
        parts = [split_tree(leaf) for leaf in tree]
        return kind(p for p, _ in parts), kind(t for _, t in parts)
    if kind is dict:
        parts = {k: split_tree(v) for k, v in tree.items()}
        return {k: p for k, (p, _) in parts.items()}, {k: t for k, (_, t) in parts.items()}
    return tree, None


def raised_entering_a_dual_level(error):
    """Whether ``error`` was raised by ``forward_ad.dual_level()`` being entered (a nested level).

    Read from the traceback's frames, not from the error's text.
    """
    codes = {forward_ad.enter_dual_level.__code__, forward_ad.dual_level.__enter__.__code__}
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return False
