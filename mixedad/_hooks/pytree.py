"""Pytree helpers: the one place mixedad touches torch's pytree utilities.

``y`` may be a tensor or any nesting of tuples, lists and dicts of tensors; results keep
that structure.

What this relies on in torch (pinned by ``tests/_hooks/test_pytree.py``): ``torch.utils._pytree``
flattens tuples, lists and dicts (and registered containers), treats None as a leaf, and
``keystr`` names a leaf's path as ``['a'][0]``.
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


def differentiable(leaf):
    """Whether a leaf of G's output carries a derivative: a floating-point tensor. Other leaves
    (integer indices, None, Python numbers) reach f as constants, as in a plain call."""
    import torch

    return isinstance(leaf, torch.Tensor) and leaf.is_floating_point()


def graph_inputs(g_leaves):
    """(``g_in``, ``g_work``, ``index``) for differentiating f in G's output.

    ``g_work``: a fresh leaf requiring grad for each differentiable leaf of g (at ``index``);
    ``g_in``: what f receives: clones of those (f may write into g, as it may in the naive code)
    and the other leaves as they are.
    """
    index = [i for i, leaf in enumerate(g_leaves) if differentiable(leaf)]
    g_work = [g_leaves[i].detach().requires_grad_() for i in index]
    g_in = list(g_leaves)
    for i, w in zip(index, g_work):
        g_in[i] = w.clone()
    return g_in, g_work, index
