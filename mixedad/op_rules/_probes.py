r"""Checks of an op's tangent against its own backward, which is the meaning.

Reverse mode says what an op's derivative is. mixedad relies on two properties that a user's
code may lack, and probes both on the op's first call with each new signature:

- **A backward linear in its incoming gradient.** The double-VJP trick (the local rule and the
  whole-G fallback) evaluates :math:`u \mapsto B(u)` at any u. Gradient clipping
  (``g.clamp(-c, c)``) and gradient normalisation (``g / g.norm()``) are not linear, and then
  only the cotangent that double backward itself feeds in, :math:`u^* = \nabla_g f(y, g)`, gives
  its answer. Probe: :math:`B(a u_1 + b u_2) = a B(u_1) + b B(u_2)` for random :math:`u_1` (unit
  scale) and :math:`u_2` (scale 1000), a = 0.5, b = -2.
- **A tangent that agrees with the backward**: a custom Function's own ``jvp``, or a rule a user
  registered (:func:`mixedad.op_rules.register`) for a torch function, a library op, an aten op
  or a Function. Forward AD would trust either. Probe, the dot-product test on random t and u:

  .. math::

      \langle \mathrm{jvp}(t), u \rangle = \langle t, B(u) \rangle

A verdict holds for one **signature**: the op (and the rule, where one is tested), which of its
arguments carry a tangent, and their dtypes. A rule right for ``a`` and wrong for ``b`` of
``torch.mul`` is caught on the first call where ``b`` carries one; one rule registered for two
ops is checked on each.

The probes run outside mixedad's dispatch, with grad enabled and a real reverse graph, on copies
of the op's inputs (its in-place writes go to the copies); every random source is put back
afterwards (:func:`mixedad._ground.random_state.undone`), and their random vectors come from a
private generator. They cost one forward, three backwards and, where a tangent is tested, one
call of it, once per signature. A probe cannot prove linearity: a clipping threshold far beyond
both scales passes it. On meta and fake tensors, which hold no values, nothing is probed (the
signature is probed on the first call with real tensors). An op whose backward cannot run (none
registered, or one that raises) cannot be checked: its tangent is trusted.
"""
import threading
import warnings
import weakref
from typing import NamedTuple, Optional, Tuple

import torch

from mixedad._ground.random_state import RandomState, undone, watching
from mixedad._hooks.dual_level import dual, dual_level_open, unpack
from mixedad._hooks.function_apply import direct, has_own_jvp
from mixedad._hooks.functorch import TangentBatch, is_wrapped, plain_example
from mixedad._hooks.pytree import tree_flatten, tree_unflatten
from mixedad._hooks.tensor_kinds import holds_values
from mixedad._ground.errors import OpRuleError

__all__ = ["Verdict", "TOLERANCE", "verdict", "verdict_in_batch", "verdict_under_transforms", "warn_disagreement",
           "new_plan"]

#: Relative tolerance of both probes, by dtype (round-off of a few sums of products).
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
_A, _B, _SCALE_2 = 0.5, -2.0, 1e3


class Verdict(NamedTuple):
    """What the probes found for one signature of one op.

    ``linear``: the backward passed the linearity probe (True where it could not be probed).
    ``jvp_agrees``: the tangent tested (a Function's jvp, a user's rule) passed the dot-product
    test (True where none was tested, or where it could not be probed). ``numbers``: the two sides
    of the test that failed, or None. ``jvp_tested``: whether the dot-product test ran (or could
    not run) for this verdict.
    """

    linear: bool
    jvp_agrees: bool
    numbers: Optional[Tuple[float, float]] = None
    jvp_tested: bool = True


_UNPROBED = Verdict(True, True)
#: owner (a Function class, or a user's rule function) -> {(op, signature): Verdict}
_verdicts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


#: owner -> the keys whose probe the current memory plan made on meta tensors (once each, as a real first call)
_planned: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def new_plan():
    """A memory plan starts: its meta run makes each probe a real first call would make, once."""
    with _lock:
        _planned.clear()


def signature(leaves):
    """Which flattened arguments carry a derivative, with their dtypes: part of a verdict's key."""
    return tuple((i, unpack(leaf)[0].dtype) for i, leaf in enumerate(leaves)
                 if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and _carries_derivative(leaf))


def verdict(owner, apply, args, kwargs, *, with_jvp, jvp=None, op=None):
    """The verdict for ``owner`` on this call's signature, probing the first time the signature is seen.

    Args:
        owner: the Function class, or a user's rule function (the cache's weak key).
        apply: ``apply(*args, **kwargs)`` runs the op as torch defines it (its backward is the meaning).
        args, kwargs: the call's arguments. In a forward-AD pass the inputs probed are those
            carrying a tangent; in a reverse pass, those that require grad.
        with_jvp: keyword-only; also run the dot-product test of ``jvp``.
        jvp: keyword-only; what pushes the dot-product test's tangent (``apply`` by default, at
            the open forward-AD level; a user's rule wrapped as a call on dual tensors).
        op: keyword-only; the op ``owner`` is checked on (``owner`` itself by default): a rule
            registered for several ops has a verdict for each.
    """
    leaves, spec = tree_flatten((args, kwargs))
    key = (owner if op is None else op, signature(leaves))
    if not _has_data(leaves):
        # Meta or fake tensors (a memory plan): nothing to compare and nothing remembered. Where a real call would
        # probe (the first of its signature, not probed before), the probe's tensors are made as it makes them,
        # so that a plan counts what the probe holds.
        with _lock:
            planned = _planned.setdefault(owner, set())
            probe = key not in planned and key not in _verdicts.get(owner, {})
            planned.add(key)
        if probe:
            with direct(), undone(), torch.enable_grad():
                _probe(apply, leaves, spec, with_jvp, jvp or apply, values=False)
        return _UNPROBED
    with _lock:
        found = _verdicts.get(owner, {}).get(key)
    if found is None or (with_jvp and not found.jvp_tested):
        with direct(), undone(), torch.enable_grad():
            found = _probe(apply, leaves, spec, with_jvp, jvp or apply)
        with _lock:
            _verdicts.setdefault(owner, {})[key] = found
    return found


def verdict_in_batch(batch, owner, apply, args, kwargs, *, with_jvp, jvp=None, op=None):
    """:func:`verdict` in a pass with a batch of tangents: probed outside torch.func, on plain tensors.

    The probes run on plain dual tensors that carry the first tangent of the batch (the probes
    draw their own random vectors; the tangent only marks which inputs carry one).
    """
    leaves, spec = tree_flatten((args, kwargs))
    lowered = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
            primal, tangent = unpack(leaf)
            primal = batch.lower_primal(primal)
            lowered.append((primal, None if tangent is None else batch.lower_tangent(tangent, primal)))
        else:
            lowered.append((leaf, None))
    with batch.plain():
        call_args, call_kwargs = tree_unflatten([p if t is None else dual(p, t[0]) for p, t in lowered], spec)
        return verdict(owner, apply, call_args, call_kwargs, with_jvp=with_jvp, jvp=jvp, op=op)


def verdict_under_transforms(cls, apply, args, kwargs):
    """:func:`verdict` inside torch.func transforms (a vmap over codes): probed outside them, on plain examples.

    Each tensor of the transforms is replaced by its first example (:func:`plain_example`); those
    with a floating dtype carry a tangent for the probes.
    """
    leaves, spec = tree_flatten((args, kwargs))
    wrapped = [isinstance(t, torch.Tensor) and is_wrapped(t) for t in leaves]
    plain = [plain_example(t) if w else t for t, w in zip(leaves, wrapped)]
    with TangentBatch.plain():
        probe = [dual(t, torch.zeros_like(t)) if w and t.is_floating_point() else t for t, w in zip(plain, wrapped)]
        call_args, call_kwargs = tree_unflatten(probe, spec)
        return verdict(cls, apply, call_args, call_kwargs, with_jvp=has_own_jvp(cls))


def _has_data(leaves):
    """Whether the tensors among ``leaves`` hold values (not meta tensors, not fake tensors)."""
    return not any(isinstance(t, torch.Tensor) and not holds_values(t) for t in leaves)


def _carries_derivative(leaf):
    """Whether an input takes part in the derivative: a tangent at mixedad's level, or requires_grad."""
    if dual_level_open():
        return unpack(leaf)[1] is not None
    return leaf.requires_grad


def _tolerance(dtype):
    return TOLERANCE.get(dtype, 1e-2)


def _close(lhs, rhs, scale, dtype):
    return abs(lhs - rhs) <= _tolerance(dtype) * scale + torch.finfo(dtype).tiny


def _probe(apply, leaves, spec, with_jvp, jvp, values=True):
    """Both probes, with grad enabled (the caller's block): the op's graph is recorded, whatever the pass does.

    Without ``values`` (meta tensors) the probes make their tensors and compare nothing."""
    work, bases, positions = list(leaves), [], []
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided:
            continue
        primal = unpack(leaf)[0] if dual_level_open() else leaf
        if _carries_derivative(leaf) and primal.is_floating_point():
            base = primal.detach().requires_grad_()
            bases.append(base)
            positions.append(i)
            work[i] = base.clone()  # a non-leaf copy: the op may write into it (mark_dirty)
        else:
            work[i] = primal.detach().clone()
    if not bases:
        return _UNPROBED
    start = RandomState()  # the tangent tested draws what the op drew (a rule for a random op: dropout's masks)
    try:
        call_args, call_kwargs = tree_unflatten(work, spec)
        with watching(start):
            out_leaves = tree_flatten(apply(*call_args, **call_kwargs))[0]
    except Exception:  # noqa: BLE001 - the real call will raise it again, with its own context
        return _UNPROBED
    live = [j for j, o in enumerate(out_leaves)
            if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]
    if not live:
        return _UNPROBED  # no backward to check against
    outs = [out_leaves[j] for j in live]
    dtype = outs[0].dtype
    generator = torch.Generator(device=outs[0].device).manual_seed(0) if values else None

    def rand(like, scale=1.0):
        if not values:
            return torch.empty(like.shape, dtype=like.dtype, device=like.device) * scale
        return torch.randn(like.shape, generator=generator, dtype=like.dtype, device=like.device) * scale

    def backward(us):
        grads = torch.autograd.grad(outs, bases, us, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(b) if g is None else g for g, b in zip(grads, bases)]

    u1, u2 = [rand(o) for o in outs], [rand(o, _SCALE_2) for o in outs]
    try:
        b1, b2 = backward(u1), backward(u2)
        mixed = backward([_A * p + _B * q for p, q in zip(u1, u2)])
    except RuntimeError:
        return _UNPROBED  # the backward itself fails: the rules that need it will say so
    for m, p, q in zip(mixed, b1, b2):
        expected = _A * p + _B * q
        scale = (_A * p).abs().max(), (-_B * q).abs().max()
        gap = m.sub(expected).abs().max()
        if values and not _close(gap.item(), 0.0, scale[0].item() + scale[1].item(), dtype):
            return Verdict(False, True)
    if not values:
        if with_jvp:
            _dot_product_test(jvp, leaves, spec, positions, bases, live, u1, b1, rand, dtype, values=False)
        return _UNPROBED
    if not with_jvp:
        return Verdict(True, True, jvp_tested=False)
    start.restore()
    agrees, numbers = _dot_product_test(jvp, leaves, spec, positions, bases, live, u1, b1, rand, dtype)
    if agrees is None:  # a rule that declined the probe's inputs: tested on the next call that has one
        return Verdict(True, True, jvp_tested=False)
    return Verdict(True, agrees, numbers)


def _dot_product_test(apply, leaves, spec, positions, bases, live, us, pulled, rand, dtype, values=True):
    """(agrees, (<jvp(t), u>, <t, B(u)>)) for random t, at the open forward-AD level; agrees is None where a rule
    declines the probe's inputs (and without ``values``: its tensors made, nothing compared)."""
    ts = [rand(b) for b in bases]
    work = [leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    for i, b, t in zip(positions, bases, ts):
        work[i] = dual(b.detach().clone(), t.clone())  # the jvp may write into its tangent
    try:
        with torch.no_grad():
            call_args, call_kwargs = tree_unflatten(work, spec)
            result = apply(*call_args, **call_kwargs)
    except OpRuleError:
        raise  # a user's rule that returns what is not a tangent, or raises: mixedad's error, naming it
    except Exception:  # noqa: BLE001 - no verdict on the jvp; the real call will show its error
        return True, None
    if result is NotImplemented:
        return None, None  # a rule that declines the probe's inputs: no verdict
    out_leaves = tree_flatten(result)[0]
    if len(out_leaves) <= max(live):
        return False, (float("nan"), float("nan"))  # fewer outputs than the op has
    pushed = [unpack(out_leaves[j])[1] if isinstance(out_leaves[j], torch.Tensor) else None for j in live]
    item = (lambda t: t.item()) if values else (lambda t: 0.0)  # on meta: the same tensors, no numbers
    lhs = sum(0.0 if p is None else item((p * u).sum()) for p, u in zip(pushed, us))
    rhs = sum(item((t * g).sum()) for t, g in zip(ts, pulled))
    scale = (sum(0.0 if p is None else item((p * u).abs().sum()) for p, u in zip(pushed, us))
             + sum(item((t * g).abs().sum()) for t, g in zip(ts, pulled)))
    return (_close(lhs, rhs, scale, dtype) if values else None), (lhs, rhs)


def warn_disagreement(call, what, pushed, numbers, fix):
    """Warn that ``what`` (a jvp, a user's rule) fails the dot-product test against the backward."""
    lhs, rhs = numbers
    warnings.warn(
        f"{call}: {what} disagrees with the backward: the dot-product test on random t, u gives "
        f"<{pushed}(t), u> = {lhs:.6g} but <t, backward(u)> = {rhs:.6g}. Reverse mode is the meaning, "
        f"so mixedad differentiates the backward instead (the local double-VJP rule). {fix}",
        RuntimeWarning, stacklevel=3)
