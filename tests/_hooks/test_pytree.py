"""Pins for mixedad._hooks.pytree: torch's pytree flattens dicts, tuples and None the way mixedad expects."""
import torch

from mixedad._hooks import pytree


def test_containers_and_none():
    tree = {"a": (torch.ones(1), None), "b": [torch.zeros(2)]}
    leaves, spec = pytree.tree_flatten(tree)
    assert len(leaves) == 3 and leaves[1] is None  # None is a leaf: OpCall's tangents and pack rely on it
    back = pytree.tree_unflatten(leaves, spec)
    assert back["a"][1] is None and back["b"][0] is leaves[2]
    assert pytree.keystr(pytree.tree_flatten_with_path(tree)[0][0][0]) == "['a'][0]"
