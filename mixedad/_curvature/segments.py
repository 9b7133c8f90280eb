r"""G as a chain of segments, and the sweeps through it that z-space curvature needs.

.. math::

    G = S_n \circ \cdots \circ S_1, \qquad s_0 = z,\quad s_i = S_i(s_{i-1}),\quad g = s_n

With :math:`L = f(y, g)`, :math:`\lambda_i = \partial L / \partial s_i` (the adjoints) and, along a
tangent :math:`u`, :math:`\dot s_i = J_{S_i} \dot s_{i-1}` (:math:`\dot s_0 = u`) and
:math:`\mu_i = \partial_\epsilon \lambda_i(z + \epsilon u)` (the second-order adjoints):

.. math::

    \lambda_{i-1} = J_{S_i}^\top \lambda_i, \qquad
    \mu_{i-1} = J_{S_i}^\top \mu_i + \partial_{s}\big\langle J_{S_i}(s)^\top \lambda_i,\ \dot s_{i-1}\big\rangle,
    \qquad \mu_n = \nabla^2_g f\ \dot g

so :math:`\mu_0 = \nabla^2_z L\, u` (the Hessian product) and :math:`\lambda_0 = \nabla_z L`.
Dropping the second term gives the Gauss-Newton product :math:`J_G^\top \nabla^2_g f\, J_G u`.

Each sweep keeps the boundaries :math:`s_i` (and for the Hessian the tangents :math:`\dot s_i`)
and recomputes one segment's graph at a time, differentiates it (twice, for the Hessian) and
frees it before the next: memory is the boundaries plus one segment's graph, not G's whole
graph. Tangents go forward through mixedad's own pass (:mod:`mixedad._frontend`), one segment
at a time, flat within each. With :math:`\sqrt{d}` segments of a depth-d G, both parts grow as
:math:`\sqrt{d}`.

Random numbers and buffers: each segment is recomputed from the random state and the buffers it
first ran from (a :class:`~mixedad._ground.state.Snapshot` of the modules it runs), so dropout
draws the same masks, and a train-mode spectral norm, whose forward steps its ``u`` and ``v``,
gives the same weight, in every sweep. A slice of G whose modules still hold, when it first runs, what
the snapshot of all of G recorded (eval mode, nothing changed by an earlier slice) shares that
snapshot's records instead of copying its buffers again (:meth:`~mixedad._ground.state.Snapshot.part`).
"""
import math
from collections import Counter
from typing import Any, List, Optional

import torch
from torch import nn

from mixedad._entry import frozen
from mixedad._frontend.batched import push_tangents
from mixedad._backend import evaluate_f
from mixedad._ground.inputs import on_inputs, writable
from mixedad._ground.state import Snapshot
from mixedad._frontend.tangents import push_tangent
from mixedad._hooks.attention_backends import differentiable_attention
from mixedad._hooks.dual_level import unpack
from mixedad._hooks.pytree import describe, differentiable, graph_inputs, tree_flatten, tree_unflatten
from mixedad import _checks
from mixedad.op_rules._attention import MathBackendWhereFusedDiffers
from mixedad._ground.errors import UnderTransformError

__all__ = ["split", "Chain", "f_derivatives", "push"]


def split(call, G, segments):
    """The segments of G: a list of callables whose composition is G.

    ``segments`` is "auto" (an ``nn.Sequential`` G of n modules in :func:`auto_count` slices; any
    other G as one segment), an int (that many slices of an ``nn.Sequential``), or a
    list of callables.
    """
    if isinstance(segments, str):
        if segments != "auto":
            raise ValueError(f"{call}: expected segments='auto', an int or a list of callables, got {segments!r}.")
        if isinstance(G, nn.Sequential) and len(G) > 1:
            return _slices(G, auto_count(len(G)))
        return [G]
    if isinstance(segments, bool) or not isinstance(segments, (int, list, tuple)):
        raise TypeError(f"{call}: expected segments='auto', an int or a list of callables, got {describe(segments)}.")
    if isinstance(segments, int):
        if segments < 1:
            raise ValueError(f"{call}: expected a positive number of segments, got {segments}.")
        if not isinstance(G, nn.Sequential):
            raise TypeError(f"{call}: segments={segments} slices an nn.Sequential G; G is a {type(G).__name__}. Pass "
                            f"segments as a list of callables whose composition is G.")
        return _slices(G, min(segments, len(G)))
    if not segments:
        raise ValueError(f"{call}: expected at least one segment, got an empty {type(segments).__name__}.")
    for i, segment in enumerate(segments):
        _checks.check_callable(call, f"segments[{i}]", segment)
    return list(segments)


def auto_count(n):
    r"""How many slices "auto" cuts an ``nn.Sequential`` of n modules into: :math:`\sqrt{n/2}`, rounded.

    A boundary costs one activation for the whole sweep, a slice's graph a few per module it
    holds (and activation modules hold little), so :math:`\sqrt{n/2}` slices balance the two for
    the usual alternation of layers and activations (the measurement behind it: docs/performance.md, "Measurements behind the design").
    """
    return max(1, round(math.sqrt(n / 2)))


def _slices(G, count):
    """``count`` slices of the ``nn.Sequential`` G, as even as can be."""
    bounds = [round(i * len(G) / count) for i in range(count + 1)]
    return [G[start:stop] for start, stop in zip(bounds, bounds[1:])]


def _zeros_where_none(values, like):
    return [torch.zeros_like(x) if v is None else v for v, x in zip(values, like)]


def push(call, G, zs, tangents, snapshot=None):
    """``(g_leaves, tangent_leaves, spec)`` for k tangents at once (each tangent with a leading k).

    One tangent takes mixedad's plain pass; several take one batched pass
    (:mod:`mixedad._frontend.batched`), or one pass each where a batch cannot be taken, each pass
    from the random state and buffers the first one started from.
    Tangents of leaves without one are zeros. ``snapshot``: None, or a snapshot that records G's state as it is
    now (just restored), for the plain passes to restart from (:func:`~mixedad._frontend.tangents.push_tangent`).
    """
    k = tangents[0].shape[0]
    if k > 1:
        try:
            g_leaves, out, spec = push_tangents(call, G, zs, tangents)
            return g_leaves, [_batch_of_zeros(g, k) if t is None else t for t, g in zip(out, g_leaves)], spec
        except UnderTransformError:
            pass
    if k == 1:
        rows = [push_tangent(call, G, zs, [t[0] for t in tangents], snapshot=snapshot)]
    else:  # one pass per tangent, each from the state the first saw (a train-mode spectral norm steps its u)
        state, rows = Snapshot(G, call=call) if snapshot is None else snapshot, []
        for j in range(k):
            if j:
                state.restore()
            with state.watching():
                rows.append(push_tangent(call, G, zs, [t[j] for t in tangents], snapshot=state))
    g_leaves, spec = rows[0][0], rows[0][2]
    stacked = []
    for i, g in enumerate(g_leaves):
        if not differentiable(g):
            stacked.append(None)
            continue
        stacked.append(torch.stack([torch.zeros_like(g) if row[1][i] is None else row[1][i] for row in rows]))
    return g_leaves, stacked, spec


def _unique_boundaries(G, segments):
    """Whether each slice's last module occurs once in G (so its forward hook marks one boundary)."""
    counts = Counter(map(id, G))
    return all(isinstance(s, nn.Sequential) and len(s) and counts[id(s[-1])] == 1 for s in segments[:-1])


def _stack(rows):
    """The rows as one tensor with a leading k (a view for k = 1)."""
    return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)


def _batch_of_zeros(g, k):
    return g.new_zeros(k, *g.shape) if differentiable(g) else None


def f_derivatives(call, f, y_leaves, y_spec, g_leaves, g_spec, g_tangents=None):
    r"""f's gradient in g, and its Hessian in g along each of k tangents: :math:`(\nabla_g f,\ \nabla^2_g f\,\dot g_j)`.

    y is a constant here. Returns ``(lam, mu)``: one entry per leaf of g (None for leaves that
    are not floating-point tensors); ``mu`` entries carry the leading k of ``g_tangents``, and
    ``mu`` is None without tangents.
    """
    y_tree = tree_unflatten([leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in y_leaves], y_spec)
    with torch.enable_grad():
        g_in, g_work, index = graph_inputs(g_leaves)
        out = evaluate_f(call, f, y_leaves, y_tree, tree_unflatten(g_in, g_spec))
        _checks.check_scalar_output(call, out)
        out = out.reshape(())
        grads = (torch.autograd.grad(out, g_work, create_graph=g_tangents is not None, allow_unused=True)
                 if out.requires_grad and g_work else [None] * len(g_work))
        lam = [None] * len(g_leaves)
        for i, gr, w in zip(index, grads, g_work):
            lam[i] = torch.zeros_like(w) if gr is None else gr.detach()
        if g_tangents is None:
            return lam, None
        k = next(t.shape[0] for t in g_tangents if t is not None)
        live = [(gr, g_tangents[i]) for i, gr in zip(index, grads) if gr is not None and gr.requires_grad]
        del grads, g_in
        rows = [_zeros_where_none(torch.autograd.grad([gr for gr, _ in live], g_work, [t[j] for _, t in live],
                                                      allow_unused=True, retain_graph=j + 1 < k), g_work)
                if live else [torch.zeros_like(w) for w in g_work] for j in range(k)]
    mu = [None] * len(g_leaves)
    for m, i in enumerate(index):
        mu[i] = rows[0][m].unsqueeze(0) if k == 1 else torch.stack([row[m] for row in rows])
    return lam, mu


class Chain:
    """G as segments, with the boundaries of one point z cached (no graph) and the sweeps through them.

    Args:
        call: the public call's name, for messages.
        segments: callables whose composition is G (:func:`split`).
        zs: the point, a tuple of tensors (G's positional inputs).
        whole: G itself when the segments are slices of it (an ``nn.Sequential``), or None.
        snapshot: None, or the caller's snapshot of G taken before the chain runs, whose records a segment shares
            where it can (:meth:`~mixedad._ground.state.Snapshot.part`).
    """

    def __init__(self, call, segments, zs, whole=None, snapshot=None):
        self.call = call
        self.segments = list(segments)
        #: G, when the segments are slices of one nn.Sequential whose boundary modules occur once in it.
        self.whole = whole if whole is not None and _unique_boundaries(whole, self.segments) else None
        self._calls = [frozen(s) for s in self.segments]
        states, self.snapshots = [[z.detach() for z in zs]], []
        #: Whether each segment wrote its input in place when it ran here: only those take copies when recomputed.
        self.writes: List[bool] = []
        with torch.no_grad():
            for i, segment in enumerate(self.segments):
                # A callable's modules are recorded as they first run; a slice of G shares the records of G's snapshot
                # where nothing changed since it was taken.
                part = Snapshot(segment, call=call) if snapshot is None else snapshot.part(segment)
                self.snapshots.append(part)
                inputs = writable(states[-1])  # a segment may write its input: not z, nor a boundary kept
                with part.watching(mode=not part.torch_only):
                    out = segment(*inputs)
                self.writes.append(any(t._version for t in inputs if isinstance(t, torch.Tensor)))
                del inputs
                leaves, self.spec = tree_flatten(out)
                if i + 1 < len(self.segments) and not all(differentiable(leaf) for leaf in leaves):
                    raise TypeError(f"{call}: segment {i} returned {describe(out)}; a segment other than the last must "
                                    f"return floating-point tensors (a tensor or a tuple of them), which the next "
                                    f"takes positionally.")
                states.append([leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])
        #: The boundaries s_0, ..., s_{n-1} (inputs of the segments), detached.
        self.states = states[:-1]
        #: G's output leaves at z (detached); the owner may drop it (``chain.output = None``) to save memory.
        self.output: Optional[List[Any]] = states[-1]

    def tangents(self, us):
        """``([ṡ_0, ..., ṡ_n], g_leaves)``: the tangents at every boundary (each leaf with the leading k of
        ``us``; zeros where a leaf has none) and G's output.

        Slices of one ``nn.Sequential`` with one tangent take one forward pass through all of G,
        the boundary tangents read by forward hooks on the slices' last modules; otherwise one
        forward pass per segment.
        """
        if self.whole is not None and us[0].shape[0] == 1:
            found = self._tangents_in_one_pass(us)
            if found is not None:
                return found
        out = [list(us)]
        for i, segment in enumerate(self.segments):
            self.snapshots[i].restore()
            g_leaves, pushed, _ = push(self.call, segment, self.states[i], out[-1], self.snapshots[i])
            out.append([t if t is not None or not differentiable(g) else g.new_zeros(us[0].shape[0], *g.shape)
                        for t, g in zip(pushed, g_leaves)])
        return out, g_leaves

    def _tangents_in_one_pass(self, us):
        captured = []

        def capture(module, inputs, output):
            tangent = unpack(output)[1] if isinstance(output, torch.Tensor) else None
            captured.append(None if tangent is None else tangent.clone())  # a later in-place op may write into it

        handles = [segment[-1].register_forward_hook(capture) for segment in self.segments[:-1]]
        try:
            self.snapshots[0].restore()
            g_leaves, pushed, _ = push(self.call, self.whole, self.states[0], us)
        finally:
            for handle in handles:
                handle.remove()
        if len(captured) != len(self.segments) - 1 or any(t is None for t in captured):
            return None  # G took another course (a fallback without dual tensors): one pass per segment
        out = [list(us)] + [[t.unsqueeze(0)] for t in captured]
        out.append([t if t is not None or not differentiable(g) else g.new_zeros(1, *g.shape)
                    for t, g in zip(pushed, g_leaves)])
        return out, g_leaves

    def _recompute(self, i):
        """Segment i's graph from its boundary, from the state it first ran from. It takes a copy of the boundary
        only where it wrote its input in place when it first ran (a copy its first op saves would add a boundary
        to the sweep's peak); a replay that writes it where the first run did not is refused, before the boundary
        is used again."""
        self.snapshots[i].restore()
        x = [s.detach().requires_grad_() for s in self.states[i]]

        def refuse(_):
            raise RuntimeError(f"{self.call}: segment {i} wrote its input in place in a sweep, which it did not do "
                               f"when the operator was built (under torch.no_grad()): the boundary mixedad keeps is "
                               f"now changed. Make the segment write its input in both grad modes or in neither.")

        return x, tree_flatten(on_inputs(self._calls[i], x, copies=self.writes[i], refuse=refuse))[0]

    def pull(self, ws):
        r"""``J_G^T w`` for k cotangents ``ws`` (one per output leaf, leading k; None where there is none)."""
        k = next(w.shape[0] for w in ws if w is not None)
        for i in reversed(range(len(self.segments))):
            with torch.enable_grad(), MathBackendWhereFusedDiffers():  # a reverse pass: exact attention
                x, out = self._recompute(i)
                live = [(o, w) for o, w in zip(out, ws) if w is not None and differentiable(o) and o.requires_grad]
                rows = []
                for j in range(k):
                    row = (torch.autograd.grad([o for o, _ in live], x, [w[j] for _, w in live], allow_unused=True,
                                               retain_graph=j + 1 < k) if live else [None] * len(x))
                    rows.append(_zeros_where_none(row, x))
            ws = [_stack([row[m] for row in rows]) for m in range(len(x))]
            del x, out, live, rows
        return ws

    def gradient(self, lam):
        r""":math:`\nabla_z L = J_G^\top \nabla_g f` for ``lam`` = :math:`\nabla_g f` (one per output leaf)."""
        pulled = self.pull([None if g is None else g.unsqueeze(0) for g in lam])
        return [p[0] for p in pulled]

    def hessian(self, lam, mu, tangents):
        r"""The second-order adjoint sweep: :math:`\nabla^2_z L\, u` for k tangents.

        ``lam``: :math:`\nabla_g f` per output leaf; ``mu``: :math:`\nabla^2_g f\,\dot g` per
        output leaf (leading k); ``tangents``: :meth:`tangents`' result. One double backward per
        segment, the first-order adjoint shared by the k tangents.
        """
        k = tangents[0][0].shape[0]
        for i in reversed(range(len(self.segments))):
            with torch.enable_grad(), differentiable_attention():  # fused kernels have no double backward
                x, out = self._recompute(i)
                live = [(o, l, m) for o, l, m in zip(out, lam, mu)
                        if l is not None and differentiable(o) and o.requires_grad]
                v = (torch.autograd.grad([o for o, _, _ in live], x, [l for _, l, _ in live], create_graph=True,
                                         allow_unused=True) if live else [None] * len(x))
                curved = [(vj, t) for vj, t in zip(v, tangents[i]) if vj is not None and vj.requires_grad]
                outputs = [o for o, _, _ in live] + [vj for vj, _ in curved]
                rows = []
                for j in range(k):
                    row = (torch.autograd.grad(outputs, x, [m[j] for _, _, m in live] + [t[j] for _, t in curved],
                                               allow_unused=True, retain_graph=j + 1 < k) if outputs else [None] * len(x))
                    rows.append(_zeros_where_none(row, x))
            lam = _zeros_where_none([None if vj is None else vj.detach() for vj in v], x)
            mu = [_stack([row[m] for row in rows]) for m in range(len(x))]
            del x, out, live, v, curved, outputs, rows
        return lam, mu
