"""Pytree helpers: the one place mixedad touches torch's pytree utilities.

``y`` may be a tensor or any nesting of tuples, lists and dicts of tensors; results keep
that structure.
"""
from torch.utils import _pytree

tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_leaves = _pytree.tree_leaves
tree_map = _pytree.tree_map
tree_flatten_with_path = _pytree.tree_flatten_with_path
keystr = _pytree.keystr


def describe(obj):
    """Short human description of an argument for error messages."""
    import torch

    if isinstance(obj, torch.Tensor):
        return f"a {obj.dtype} tensor of shape {tuple(obj.shape)} on {obj.device}"
    return f"{type(obj).__name__}"
