"""What an autograd graph keeps alive: graph_report."""
from typing import Dict, List, Sequence, Tuple, Union
import collections

import torch

__all__ = ["graph_report", "GraphReport"]


def _saved_tensors(node):
    """The tensors a backward node saved, through PyTorch's ``_saved_*`` attributes."""
    found = []
    names = [n for n in dir(node) if n.startswith("_saved_")]
    if hasattr(node, "saved_tensors") and not names:  # custom autograd.Function nodes
        names = ["saved_tensors"]
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:  # freed by a backward without retain_graph
            continue
        values = value if isinstance(value, (tuple, list)) else [value]
        found += [v for v in values if isinstance(v, torch.Tensor)]
    return found


class GraphReport:
    r"""The result of :func:`graph_report`: counts, saved bytes, a per-op breakdown, the leaves.

    .. math::

        \mathrm{saved\_bytes} = \sum_{\mathrm{op}} \mathrm{by\_op}[\mathrm{op}]_{\mathrm{bytes}}

    Example:
        >>> import torch
        >>> from mixedad import graph_report
        >>> x = torch.randn(10, requires_grad=True)
        >>> print(graph_report((x * x).sum()))  # doctest: +ELLIPSIS
        graph: 3 nodes, 0.000 MiB saved for backward, 1 leaves
        ...

    Attributes:
        nodes: number of backward nodes reachable from the tensor.
        saved_bytes: bytes of the storages saved for backward, each storage counted once.
        by_op: ``{op name: (nodes, saved bytes)}``; a storage saved by several ops counts for the
            first one reached.
        leaves: the leaf tensors that would receive gradients (their AccumulateGrad nodes).
    """

    def __init__(self, nodes: int, saved_bytes: int, by_op: Dict[str, Tuple[int, int]], leaves: List[torch.Tensor]) -> None:
        self.nodes, self.saved_bytes, self.by_op, self.leaves = nodes, saved_bytes, by_op, leaves

    def __str__(self) -> str:
        lines = [f"graph: {self.nodes} nodes, {self.saved_bytes / 2**20:.3f} MiB saved for backward, "
                 f"{len(self.leaves)} leaves",
                 f"{'op':<32}{'nodes':>7}{'saved':>14}"]
        for op, (count, nbytes) in sorted(self.by_op.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"{op:<32}{count:>7}{nbytes / 2**20:>10.3f} MiB")
        for leaf in self.leaves[:8]:
            lines.append(f"leaf: {tuple(leaf.shape)} {leaf.dtype} on {leaf.device}")
        if len(self.leaves) > 8:
            lines.append(f"... and {len(self.leaves) - 8} more leaves")
        return "\n".join(lines)

    __repr__ = __str__


def graph_report(t: Union[torch.Tensor, Sequence[torch.Tensor]]) -> GraphReport:
    r"""Walk ``t.grad_fn`` and report what the graph behind t keeps alive for backward.

    .. math::

        \mathrm{saved\_bytes} = \sum_{s \in \mathcal{S}} \mathrm{nbytes}(s), \qquad
        \mathcal{S} = \{\text{storages of the tensors saved by nodes reachable from } t\}

    Storages are deduplicated, so a tensor saved by two nodes (or an output saved by its own
    node) counts once; parameters saved for backward count too. A tensor without grad_fn (made
    under ``no_grad``, detached, or a leaf) reports zero. A graph already freed by a backward
    without ``retain_graph`` reports its nodes but no saved bytes. ``t`` may be a tensor or a
    sequence of tensors (one walk over all of them).

    Returns:
        A :class:`GraphReport`; ``print`` it for a short table.

    Example:
        >>> import torch
        >>> from mixedad import graph_report
        >>> w = torch.randn(100, requires_grad=True)
        >>> report = graph_report(w.exp().sum())
        >>> report.nodes, report.saved_bytes, len(report.leaves)
        (3, 400, 1)
    """
    roots = list(t) if isinstance(t, (list, tuple)) else [t]
    for r in roots:
        if not isinstance(r, torch.Tensor):
            raise TypeError(f"graph_report(t): expected a tensor or a sequence of tensors, got {type(r).__name__}.")
    stack: list = [r.grad_fn for r in roots if isinstance(r, torch.Tensor) and r.grad_fn is not None]
    seen: set = set()
    storages: set = set()
    leaves: list = []
    by_op: Dict[str, List[int]] = collections.defaultdict(lambda: [0, 0])
    saved_total = 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        op = type(node).__name__
        by_op[op][0] += 1
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        for tensor in _saved_tensors(node):
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in storages or tensor.device.type == "meta":
                continue
            storages.add(key)
            saved_total += storage.nbytes()
            by_op[op][1] += storage.nbytes()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return GraphReport(len(seen), saved_total, {k: (v[0], v[1]) for k, v in by_op.items()}, leaves)
