r"""Pushing tangents forward through a frozen generator G: mixedad's front end.

The front end computes :math:`g = G(z)` and :math:`\dot g = J_G(z)\, v` together. What happens
to each op of G is decided in one place, :mod:`mixedad.op_rules`; this module runs the pass:

- **forward** (the default): forward-mode AD, G running with grad enabled as in a plain call and
  grad mode read at each op (:mod:`mixedad._ground.grad_mode`: what G computes with grad off is a
  constant; ops run with grad on record no reverse graph). Outside torch.func
  transforms it uses ``torch.autograd.forward_ad`` (dual tensors), which also runs BatchNorm in
  train mode (its running statistics are updated once and never become dual), with
  :class:`mixedad.op_rules.OpRules` deciding each op's path: fast frozen-layer rules, written
  formulas, the local double-VJP rule for ops forward mode cannot take (custom
  ``autograd.Function``\ s without ``jvp`` included), or PyTorch's own formula. When an op's
  formula raises, the pass is restored and run again with that op on the local rule. A batch
  of tangents (``mixed_jacobian``, a vmap over v alone) goes through
  :mod:`mixedad._frontend.batched`, with the same rules. Inside other torch.func transforms (a
  vmap that batches z) it uses ``torch.func.jvp`` and PyTorch's formulas only. Memory: one forward pass holding primal and tangent, flat in G's
  depth. ``F.scaled_dot_product_attention`` keeps the user's fused kernel for the primal and
  takes a blockwise tangent (:mod:`mixedad.op_rules._attention`); the nn.MultiheadAttention /
  TransformerEncoderLayer fast path is switched off during the pass, because its fused kernels
  bypass SDPA and have no forward-AD formula. Inside torch.func transforms, attention runs
  through the math SDPA backend.
- **reverse** (the whole-G fallback): the double-VJP trick for all of G, :math:`J_G v =
  \partial_u \langle J_G^\top u, v\rangle` (:mod:`mixedad.op_rules._double_vjp`). It needs no forward-mode
  formula but keeps G's graph: memory grows with depth. ``strategy="auto"`` takes it, with a
  warning, only where the forward pass cannot go on: inside the caller's own
  ``forward_ad.dual_level()``, an op that fails inside a torch.func transform, or an output that
  comes back without a tangent (G detaches its input, or a compiler dropped the tangent).

A ``torch.compile``'d G is replaced by its original eager module or function, with a warning:
compiled graphs do not carry forward-mode tangents reliably, and compiled dropout draws
different random numbers than eager replays would.
"""
import functools

import torch
from torch import nn
from torch.autograd import forward_ad
from torch.func import jvp, vjp

from mixedad._entry import frozen, warn_once
from mixedad._frontend.restarts import run_restarting
from mixedad._ground.forward_pass import forward_pass
from mixedad._ground.grad_mode import ReadGradMode
from mixedad._ground.nesting import one_pass
from mixedad._ground.inputs import PassInputs, writable
from mixedad._ground.state import Snapshot
from mixedad._programs.cache import push_compiled, push_program
from mixedad._hooks.attention_backends import differentiable_attention
from mixedad._hooks.function_apply import routing
from mixedad._hooks.functorch import in_functorch_transform
from mixedad._hooks.module_hooks import backward_hooks
from mixedad._hooks.pytree import describe, differentiable, tree_flatten
from mixedad._hooks.threads import watching_threads
from mixedad.op_rules._dispatch import (REVERSE_MODE_INSIDE, SKIPPABLE, OpRules, skipped_paths,
                                        untrusted_under_transforms)
from mixedad.op_rules._custom_functions import FunctionsUnderTransforms, ReverseMode
from mixedad.op_rules._double_vjp import double_vjp
from mixedad._ground.errors import NeedsWholeG, UnderTransformError

def _check_outputs(call, g_leaves, out=None):
    """G's output must hold a floating-point tensor; its other leaves (indices, None) reach f as constants."""
    if not g_leaves:
        raise ValueError(f"{call}: expected G(z) to return a tensor or a pytree holding at least one tensor, "
                         f"got {describe(out)}.")
    complex_leaves = [i for i, leaf in enumerate(g_leaves) if isinstance(leaf, torch.Tensor) and leaf.is_complex()]
    if complex_leaves:
        where = "G(z)" if len(g_leaves) == 1 else f"G(z)'s leaf {complex_leaves[0]}"
        raise TypeError(f"{call}: {where} is complex ({describe(g_leaves[complex_leaves[0]])}); mixedad takes "
                        f"real outputs. Return torch.view_as_real(x) instead (f then sees the real and "
                        f"imaginary parts as a last dimension of size 2).")
    if not any(differentiable(leaf) for leaf in g_leaves):
        what = describe(out) if len(g_leaves) > 1 else describe(g_leaves[0])
        raise TypeError(f"{call}: expected G(z) to be a floating-point tensor or a tuple, list or dict holding one, "
                        f"got {what}. Return the tensors in a tuple or dict (or register your container "
                        f"with torch.utils._pytree.register_pytree_node).")


def _tensors_only(call, G, refusal):
    """G for torch.func.jvp and vjp, which need tensors: its flat leaves, and the spec on the side.

    Returns ``(G_flat, spec)``; ``spec[0]`` holds the output's pytree spec once G has run. A G
    whose output holds other leaves (indices, None) is refused there: ``refusal(reason)``.
    """
    spec = [None]

    def G_flat(*zs):
        out = G(*zs)
        leaves, spec[0] = tree_flatten(out)
        _check_outputs(call, leaves, out)
        if not all(differentiable(leaf) for leaf in leaves):
            raise refusal("G(z) holds leaves that are not floating-point tensors")
        return tuple(leaves)

    return G_flat, spec


def _forward(call, G, zs, vs, rules, *, inputs=None):
    """Forward-mode pass. Returns (primal leaves, tangent leaves or None where lost, spec).

    G runs with grad enabled, as in a plain call; grad mode is read at each op
    (:mod:`mixedad._ground.grad_mode`). ``rules`` is the :class:`mixedad.op_rules.OpRules` dispatch,
    which steps aside inside torch.func transforms; None for PyTorch's formulas only. ``inputs``: the
    call's :class:`~mixedad._ground.inputs.PassInputs`, kept across restarts (new ones by default).
    """
    if inputs is None:
        inputs = PassInputs(zs, vs)
    if rules is None:
        rules = OpRules(call, skip=SKIPPABLE)
    if in_functorch_transform():
        def refusal(reason):
            return UnderTransformError(
                f"{call}: {reason}, which mixedad cannot follow inside a torch.func transform (vmap over "
                f"mixed_grad, or a batched pass). Call mixed_grad once per tangent (mixed_jacobian does "
                f"that by itself), where mixedad gives double backward's answer.")

        if isinstance(G, nn.Module) and backward_hooks(G.modules()):
            raise refusal(_HOOKED)
        try:
            read_grad_mode = ReadGradMode(REVERSE_MODE_INSIDE, refusal, untrusted_under_transforms, rules.recorder)
            with torch.enable_grad(), differentiable_attention(), \
                    routing(FunctionsUnderTransforms(call, read_grad_mode)), watching_threads() as threads:
                G_flat, spec = _tensors_only(call, G, refusal)
                with read_grad_mode:
                    g, g_dot = jvp(G_flat, tuple(z.detach() for z in zs), tuple(v.detach() for v in vs))
                if not torch.is_grad_enabled():
                    raise refusal("G leaves grad mode off when it returns")
            if threads:
                raise refusal(_THREADS)
        except NeedsWholeG as error:
            raise refusal(str(error)) from error
        return list(g), list(g_dot), spec[0]
    rules.inputs = inputs
    with forward_pass(rules), forward_ad.dual_level():
        duals = [forward_ad.make_dual(z, v) for z, v in zip(inputs.primals(), inputs.tangents())]
        with watching_threads() as threads:
            with rules, routing(rules):
                out = G(*duals)
        if threads:
            raise NeedsWholeG(_THREADS)
        out_leaves, spec = tree_flatten(out)
        _check_outputs(call, out_leaves, out)
        unpacked = [forward_ad.unpack_dual(leaf) if differentiable(leaf) else (leaf, None) for leaf in out_leaves]
    return [u[0] for u in unpacked], [u[1] for u in unpacked], spec


_THREADS = ("G starts threads while it runs, and mixedad's dispatch (grad mode, per-op rules) cannot "
            "follow it into them")


def _reverse(call, G, zs, vs, cotangent=None, at_cotangent=False, copies=True):
    r"""Whole-G double VJP: :math:`J v = \partial_u \langle J^\top u, v\rangle`. Keeps G's graph.

    The derivative in u is taken at u = 1, unless G's backward may not be linear in u
    (``at_cotangent``, or a gradient hook or a custom Function found on the way): then at
    double backward's own cotangent ``cotangent(g_leaves)``, :math:`u^* = \nabla_g f(y, g)`,
    which reproduces exactly what double backward computes. Memory grows with G's depth. G gets
    copies of z that it may write (:func:`~mixedad._ground.inputs.writable`), unless ``copies``
    is False: after a forward pass that saw G write no input, G takes z itself (a copy G's first op
    saves would add z's size to the graph).
    """
    if in_functorch_transform():
        G_flat, spec = _tensors_only(call, G, lambda reason: UnderTransformError(f"{call}: {reason} inside a torch.func "
                                                                                  f"transform; call mixed_grad once "
                                                                                  f"per tangent."))
        g, pullback = vjp(G_flat, *zs)
        _, pullback_of_pullback = vjp(pullback, tuple(torch.ones_like(t) for t in g))
        (g_dot,) = pullback_of_pullback(tuple(vs))
        return [leaf.detach() for leaf in g], list(g_dot), spec[0]
    watch = ReverseMode()
    with torch.enable_grad(), differentiable_attention(), routing(watch):
        z_work = [z.detach().requires_grad_() for z in zs]
        with watch:
            out = frozen(G)(*(writable(z_work) if copies else z_work))
        g_leaves, spec = tree_flatten(out)
        _check_outputs(call, g_leaves, out)
        at_cotangent = at_cotangent or watch.at_cotangent
        live = [i for i, leaf in enumerate(g_leaves) if differentiable(leaf) and leaf.requires_grad]
        tangents = [torch.zeros_like(leaf) if differentiable(leaf) else None for leaf in g_leaves]
        if live:
            at = None
            if at_cotangent and cotangent is not None:
                at = [cotangent([leaf.detach() for leaf in g_leaves], spec)[i] for i in live]
            pushed = double_vjp(call, "G", [g_leaves[i] for i in live], z_work, list(vs), at=at)
            for i, t in zip(live, pushed):
                tangents[i] = t
    return [leaf.detach() if differentiable(leaf) else leaf for leaf in g_leaves], tangents, spec


def _g_name(G):
    return type(G).__qualname__ if isinstance(G, nn.Module) else getattr(G, "__qualname__", type(G).__name__)


def _whole_g(call, G, zs, vs, strategy, reason, recorder, cotangent, at_cotangent=False, copies=True):
    """The whole-G fallback, or an error for strategy='forward'."""
    if strategy == "forward":
        raise RuntimeError(
            f"{call}: {reason}, so mixedad would need the whole-G double-VJP fallback, whose memory "
            f"grows with G's depth, and strategy='forward' forbids it. Use strategy='auto' (the "
            f"fallback, with a warning) or 'reverse'."
        )
    if at_cotangent and in_functorch_transform():
        raise UnderTransformError(f"{call}: {reason}, which mixedad cannot follow inside a torch.func transform "
                                  f"(vmap over mixed_grad, or a batched pass). Call mixed_grad once per tangent "
                                  f"(mixed_jacobian does that by itself).")
    if recorder is not None:
        recorder.fallback = reason
    warn_once(("whole-G", reason, _g_name(G)),
               f"mixedad: {reason}; pushing tangents through all of G with two reverse passes instead "
               f"(the double-VJP trick). Memory now grows with G's depth.")
    return _reverse(call, G, zs, vs, cotangent, at_cotangent, copies)


def push_tangent(call, G, zs, vs, *, strategy="auto", recorder=None, cotangent=None, compile=False, snapshot=None):
    r"""Evaluate G at z and push the tangent v through it.

    .. math::

        g = G(z_1, \ldots, z_k), \qquad \dot g = \sum_i \partial_{z_i} G\; v_i

    Where G's backward may not be linear in its incoming gradient (a gradient hook, a custom
    Function that clips or normalises its gradient), :math:`\dot g` is what double backward
    computes: :math:`\partial_u \langle J_G(u)^\top u, v\rangle` at :math:`u^* =` ``cotangent``.

    Args:
        call: the public call's name, for messages.
        G: callable taking the tensors of ``zs`` positionally.
        zs, vs: sequences of primal tensors and matching tangents.
        strategy: "auto", "forward" or "reverse" (see the module docstring). "forward" allows
            every per-op rule (all flat in memory) and refuses only the whole-G fallback.
        recorder: None, or a :class:`mixedad.op_rules.PathRecorder` to count which op took
            which path.
        cotangent: None (u = 1 is good enough: the report), or ``cotangent(g_leaves, spec)``
            returning :math:`\nabla_g f(y, g)` per leaf, for G whose backward is not linear.
        compile: run G's compiled tangent program (:mod:`mixedad._programs.cache`), checked
            against this eager pass on its first call, and falling back to it where none runs.
        snapshot: None, or a :class:`~mixedad._ground.state.Snapshot` that records G's state as it is now (a
            replay that has just restored it), which a restart of the pass restores, instead of a new one.

    Returns:
        ``(g_leaves, tangent_leaves, spec)``: G's flattened output, the matching tangents
        (detached, no graph), and the pytree spec of G's output.

    Raises:
        NestedCallError: called while a pass of this thread runs G.
    """
    with one_pass(call):
        if strategy == "reverse":
            if recorder is not None:
                recorder.fallback = "strategy='reverse'"
            return _reverse(call, G, zs, vs, cotangent)
        forward = functools.partial(_push_forward, call, G, zs, vs, strategy, cotangent, recorder=recorder,
                                    snapshot=snapshot)
        if compile:
            return push_compiled(call, G, zs, vs, forward)
        if recorder is None and not skipped_paths():  # a report, or a pass told to skip rules, takes the per-op pass
            return push_program(call, G, zs, vs, forward)
        return forward()


class _Refused:
    """The result of a call whose forward pass could not go on (the whole-G fallback's)."""

    def __init__(self, result):
        self.result = result


def _push_forward(call, G, zs, vs, strategy, cotangent, *, recorder=None, snapshot=None):
    rules, inputs = OpRules(call, recorder), PassInputs(zs, vs)

    def whole_g(reason, at_cotangent=False):  # G gets copies of z only where the forward pass saw it write one
        return _whole_g(call, G, zs, vs, strategy, reason, recorder, cotangent, at_cotangent, copies=inputs.private)

    if snapshot is None:
        snapshot = Snapshot(G, call=call)
    if backward_hooks(snapshot.modules):
        return whole_g(_HOOKED, at_cotangent=True)
    passed = run_restarting(lambda: _forward(call, G, zs, vs, rules, inputs=inputs), snapshot,
                            lambda reason, at_cotangent=False: _Refused(whole_g(reason, at_cotangent)),
                            recorder=recorder, inputs=inputs)
    if isinstance(passed, _Refused):
        return passed.result
    g_leaves, tangents, spec = passed
    if backward_hooks(snapshot.modules):  # modules that a G which is not a Module ran
        snapshot.restore()
        return whole_g(_HOOKED, at_cotangent=True)
    lost = [i for i, t in enumerate(tangents) if t is None and differentiable(g_leaves[i])]
    if not lost:
        return g_leaves, tangents, spec
    where = "G(z)" if len(tangents) == 1 else f"G(z)'s leaves {lost}"
    if strategy == "forward":
        raise RuntimeError(
            f"{call}: {where} came back without a forward-mode tangent: G does not depend on z there, "
            f"or it drops tangents (detach(), a compiled graph, a custom op). strategy='forward' "
            f"cannot tell which; use strategy='auto' or 'reverse'."
        )
    snapshot.restore()
    g_leaves, tangents, spec = _reverse(call, G, zs, vs, cotangent, copies=inputs.private)
    if any(tangents[i].ne(0).any() for i in lost):
        reason = (f"{where} lost its forward-mode tangent although it depends on z (detach() inside G, a "
                  f"compiled graph, or a custom op?)")
        if recorder is not None:
            recorder.fallback = reason
        warn_once(("lost", _g_name(G)),
                   f"mixedad: {reason}; computed it with two reverse passes instead. Memory now grows "
                   f"with G's depth.")
    return g_leaves, tangents, spec


_HOOKED = "a module of G has backward hooks (register_full_backward_hook), which forward mode never runs"
