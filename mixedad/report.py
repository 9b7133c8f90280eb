r"""Which op took which path: a report to run once on a new generator.

PyTorch's forward mode has silent gaps, so a user who brings a new G should see how mixedad
pushes tangents through it: per op, how many calls took a fast frozen-layer rule, a written
formula, the local double-VJP rule (and why), PyTorch's own formula, and whether all of G fell
back to two reverse passes (and why).
"""
from typing import Any, Callable, List, Sequence, Union

import torch
from mixedad import _checks
from mixedad._entry import public_call
from mixedad.op_rules import PATHS, PathRecorder
from mixedad.op_rules._dispatch import WHOLE_G
from mixedad._ground.state import Snapshot
from mixedad._entry import eager
from mixedad._frontend.batched import push_under_vmap
from mixedad._frontend.tangents import push_tangent
from mixedad._hooks.functorch import in_functorch_transform
from mixedad._programs.cache import runs_program

__all__ = ["TangentReport", "tangent_report"]


class TangentReport:
    r"""Per-op counts of the paths tangents took through G in one pass.

    .. math::

        \mathrm{calls}(\mathrm{path}) = \#\{\text{op calls in } G(z) \text{ whose tangent took path}\}

    Attributes:
        rows: list of ``(op, path, reason, calls)``, ordered by path, then op.
        fallback: None, or why all of G took the whole-G fallback (memory grows with depth).
        route: what :func:`mixedad.mixed_grad` runs for G at these inputs now: ``"per-op pass"`` (the
            rows are its paths), or ``"tangent program"`` (an ``nn.Sequential`` of ``torch.nn``
            layers called again with the same inputs' layouts runs a program checked against the per-op
            pass, with mixedad's own rules: a G that meets a user's rule never does).

    Example:
        >>> import torch, mixedad
        >>> report = mixedad.tangent_report(torch.nn.Linear(3, 3), torch.randn(2, 3))
        >>> report.ops("frozen layer")
        ['torch.nn.functional.linear']
    """

    def __init__(self, recorder: Any, route: str = "per-op pass") -> None:
        self.route = route
        order = {path: i for i, path in enumerate(PATHS)}
        self.rows = sorted(((op, path, reason, n) for (op, path, reason), n in recorder.counts.items()),
                           key=lambda row: (order[row[1]], row[0], row[2]))
        self.fallback = recorder.fallback

    def calls(self, path: str) -> int:
        """How many op calls took ``path`` (one of :data:`mixedad.op_rules.PATHS`)."""
        return sum(n for _, p, _, n in self.rows if p == path)

    def ops(self, path: str) -> List[str]:
        """The names of the ops that took ``path`` at least once."""
        return sorted({op for op, p, _, _ in self.rows if p == path})

    @property
    def flat(self) -> bool:
        """True when no whole-G fallback was needed: memory does not grow with G's depth."""
        return self.fallback is None

    def __str__(self) -> str:
        header = ("op", "path", "reason", "calls")
        body = [(op, path, reason, str(n)) for op, path, reason, n in self.rows]
        if self.fallback is not None:
            body.append(("G (all of it)", WHOLE_G, self.fallback, "1"))
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(4)]
        line = lambda r: "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
        summary = ("memory: flat in G's depth" if self.flat
                   else "memory: GROWS with G's depth (whole-G fallback)")
        route = (f"route: {self.route}" if self.route == "per-op pass" else
                 f"route: {self.route} (mixedad's own rules for G's layers; the rows are the per-op pass it was "
                 f"checked against)")
        return "\n".join([route, line(header), line(["-" * w for w in widths]), *map(line, body), summary])

    def __repr__(self) -> str:
        return f"TangentReport({len(self.rows)} rows, fallback={self.fallback!r}, route={self.route!r})"


@public_call
def tangent_report(G: Callable[..., Any], z: Union[torch.Tensor, Sequence[torch.Tensor]], v: Any = None, *,
                   strategy: str = "auto") -> TangentReport:
    r"""Push one tangent through G and report, per op, which path it took.

    .. math::

        \dot g = J_G(z)\, v \quad\text{(computed and discarded; only the paths are kept)}

    Runs the same forward pass as :func:`mixedad.mixed_grad` (strategy as there) and counts every
    op call that produced a tangent: ``frozen layer``, ``written formula``, ``local double-VJP``
    (with the reason: known-wrong formula, no formula, a formula that raised, a custom Function
    without ``jvp``) and ``forward AD``; and whether G needed the ``whole-G fallback``, whose
    memory grows with depth (that still warns). G is left as it was: its random state and
    buffers are restored. Memory and time: one call of mixed_grad's forward pass.

    Args:
        G: callable or ``nn.Module``.
        z: floating-point tensor, or a tuple of them that G takes positionally.
        v: tangent with z's structure; defaults to ones.
        strategy: keyword-only; "auto" or "forward" ("reverse" reports only the fallback).

    Returns:
        A :class:`TangentReport`; ``print(report)`` shows the table.

    Example:
        >>> import torch, mixedad
        >>> report = mixedad.tangent_report(mixedad.zoo.mlp(2, 4), torch.randn(3, 4))
        >>> report.calls("frozen layer"), report.flat
        (2, True)
    """
    call = "tangent_report(G, z)"
    _checks.check_callable(call, "G", G)
    zs = _checks.flatten_z(call, z)
    vs = _checks.flatten_v(call, z, zs, v)
    _checks.check_strategy(call, strategy)
    G = eager(G)
    recorder = PathRecorder()
    route = "tangent program" if strategy == "auto" and runs_program(G, zs, vs) else "per-op pass"
    undo = Snapshot(G, call=call)
    try:
        with undo.watching():
            pushed = None
            if strategy != "reverse" and in_functorch_transform():  # a user's vmap over tangents
                pushed = push_under_vmap(call, G, zs, vs, recorder=recorder)
            if pushed is None:
                push_tangent(call, G, zs, vs, strategy=strategy, recorder=recorder)
    finally:
        undo.restore()
    return TangentReport(recorder, route)
