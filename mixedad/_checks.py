"""Argument validation shared by mixedad's public functions.

Every message opens with the call it belongs to (``mixed_grad(f, G, z, y): ...``), says what
was expected and what came in, and the fix where there is one. Wrong kinds raise TypeError,
wrong shapes or values ValueError.
"""
import torch

from mixedad._trees import describe, tree_flatten


def check_callable(call, name, obj):
    if not callable(obj):
        raise TypeError(
            f"{call}: expected {name} to be callable (a function or nn.Module), "
            f"got {describe(obj)}."
        )


def check_float_tensor(call, name, obj):
    if not isinstance(obj, torch.Tensor):
        raise TypeError(f"{call}: expected {name} to be a tensor, got {describe(obj)}.")
    if not obj.is_floating_point():
        raise TypeError(
            f"{call}: expected {name} to be a real floating-point tensor, got dtype "
            f"{obj.dtype}. Convert it, e.g. {name}.to(torch.float32)."
        )


def flatten_y(call, y):
    """Flatten y (a tensor or a pytree of tensors) and check every leaf is floating point."""
    leaves, spec = tree_flatten(y)
    if not leaves:
        raise ValueError(f"{call}: expected y to hold at least one tensor, got an empty {describe(y)}.")
    for i, leaf in enumerate(leaves):
        name = "y" if isinstance(y, torch.Tensor) else f"y's leaf {i}"
        check_float_tensor(call, name, leaf)
    return leaves, spec


def check_like(call, name, obj, like, like_name):
    """Check that obj is a tensor with like's shape, dtype and device."""
    if not isinstance(obj, torch.Tensor):
        raise TypeError(f"{call}: expected {name} to be a tensor, got {describe(obj)}.")
    if obj.shape != like.shape:
        raise ValueError(
            f"{call}: {name} must have {like_name}'s shape {tuple(like.shape)}, "
            f"got {tuple(obj.shape)}."
        )
    if obj.dtype != like.dtype:
        raise TypeError(
            f"{call}: {name} must have {like_name}'s dtype {like.dtype}, got {obj.dtype}."
        )
    if obj.device != like.device:
        raise ValueError(
            f"{call}: {name} must be on {like_name}'s device {like.device}, got {obj.device}."
        )


def check_scalar_output(call, out):
    """Check that f returned a floating-point tensor with one element."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"{call}: expected f(y, g) to return a scalar tensor, got {describe(out)}."
        )
    if out.numel() != 1:
        raise ValueError(
            f"{call}: expected f(y, g) to return a scalar tensor, got shape "
            f"{tuple(out.shape)}. Reduce it, e.g. with .sum()."
        )
    if not out.is_floating_point():
        raise TypeError(
            f"{call}: expected f(y, g) to return a floating-point scalar, got dtype {out.dtype}."
        )


def mixed_args(call, f, G, z, y, v):
    """Validate the ``f, G, z, y, v`` arguments shared by mixedad's mixed derivatives.

    Returns ``(y_leaves, y_spec, v)`` with v defaulted to ``torch.ones_like(z)``.
    """
    check_callable(call, "f", f)
    check_callable(call, "G", G)
    check_float_tensor(call, "z", z)
    y_leaves, y_spec = flatten_y(call, y)
    if v is None:
        v = torch.ones_like(z)
    else:
        check_like(call, "v", v, z, "z")
    return y_leaves, y_spec, v
