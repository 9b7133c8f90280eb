"""Reading autograd's graph: the nodes that say a backward cannot be differentiated again.

What this relies on in torch (pinned by ``tests/_hooks/test_autograd_graph.py``): walking
``grad_fn.next_functions`` reaches every node of a graph; the backward of a
``@once_differentiable`` Function records a node of type ``Error`` or ``DelayedError`` in the
graph it builds; a ``torch.compile``'d region's backward node is of a type whose name contains
``CompiledFunction``.
"""


def _nodes(roots):
    seen, stack = set(), [t.grad_fn for t in roots]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(n for n, _ in node.next_functions)


def once_differentiable_node(roots):
    """The name of a ``@once_differentiable`` error node in the graphs of ``roots``, or None."""
    for node in _nodes(roots):
        if type(node).__name__ in ("Error", "DelayedError"):
            return type(node).__name__
    return None


def compiled_region(roots):
    """Whether the graphs of ``roots`` hold a ``torch.compile``'d region's backward."""
    return any("CompiledFunction" in type(node).__name__ for node in _nodes(roots))
