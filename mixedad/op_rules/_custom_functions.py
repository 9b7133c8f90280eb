r"""Two checks on a custom ``autograd.Function`` class, made once, the first time a pass meets it.

Reverse mode is the meaning: a Function's ``backward`` says what its derivative is. mixedad
relies on two properties of it that a user's Function may lack:

- **A backward linear in its incoming gradient.** The double-VJP trick (the local rule and the
  whole-G fallback) evaluates :math:`u \mapsto B(u)` at any u. Gradient clipping
  (``g.clamp(-c, c)``) and gradient normalisation (``g / g.norm()``) are not linear, and then
  only the cotangent that double backward itself feeds in, :math:`u^* = \nabla_g f(y, g)`, gives
  its answer. Probe: :math:`B(a u_1 + b u_2) = a B(u_1) + b B(u_2)` for random :math:`u_1` (unit
  scale) and :math:`u_2` (scale 1000), a = 0.5, b = -2.
- **A jvp that agrees with the backward.** Forward AD would trust a wrong ``jvp``. Probe, the
  dot-product test on random t and u:

  .. math::

      \langle \mathrm{jvp}(t), u \rangle = \langle t, B(u) \rangle

The probes run the Function once more on copies of its inputs (its in-place writes go to the
copies), with the random state restored afterwards, and draw their random vectors from a private
generator: the user's RNG is untouched. They cost one forward, three backwards and, for a
Function with ``jvp``, one jvp of that op, once per class. A probe cannot prove linearity: a
clipping threshold far beyond both scales passes it. On meta and fake tensors, which hold no
values, nothing is probed (the class is probed on the first call with real tensors).
"""
import contextlib
import functools
import threading
import warnings
import weakref
from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from mixedad._frontend.grad_mode import no_graph, run_as_constant
from mixedad._hooks.checkpoint import CheckpointFunction, run_directly
from mixedad._hooks.dual_level import any_tangent, dual, dual_level_open, unpack
from mixedad._hooks.function_apply import direct, has_own_jvp, has_own_vmap, has_setup_context, original_apply
from mixedad._hooks.functorch import TangentBatch, is_wrapped, plain_example, under_vmap
from mixedad._hooks.module_hooks import BackwardHookFunction
from mixedad._hooks.threads import unwatched
from mixedad._hooks.torch_function_stack import popped
from mixedad.op_rules._errors import FunctionUnderTransformError, NeedsWholeG, OpRuleError, UnderTransformError
from mixedad.op_rules._local import local_jvp
from mixedad.op_rules._table import Path

from mixedad._hooks.pytree import tree_flatten, tree_unflatten
from mixedad._hooks.tensor_kinds import holds_values
from mixedad._frontend.state import RngState

#: Relative tolerance of both probes, by dtype (round-off of a few sums of products).
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
_A, _B, _SCALE_2 = 0.5, -2.0, 1e3


class Verdict(NamedTuple):
    """What the probes found for one Function class.

    ``linear``: the backward passed the linearity probe (True where it could not be probed).
    ``jvp_agrees``: the class's own jvp passed the dot-product test (True without a jvp, or
    where it could not be probed). ``numbers``: the two sides of the test that failed, or None.
    ``jvp_tested``: whether the dot-product test ran (or could not run) for this verdict.
    """

    linear: bool
    jvp_agrees: bool
    numbers: tuple = None
    jvp_tested: bool = True


_UNPROBED = Verdict(True, True)
_verdicts = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def forget():
    """Clear the remembered verdicts (for tests)."""
    with _lock:
        _verdicts.clear()


def verdict(cls, apply, args, kwargs, *, with_jvp, jvp=None):
    """The verdict for ``cls``, probing on these arguments the first time the class is seen.

    Args:
        cls: the Function class (the cache key), or a user's rule.
        apply: ``apply(*args, **kwargs)`` runs the Function as torch defines it.
        jvp: keyword-only; what pushes the dot-product test's tangent (``apply`` by default, at
            the open forward-AD level; a user's rule wrapped as a call on dual tensors).
        args, kwargs: the call's arguments. In a forward-AD pass (``with_jvp`` given either
            way) the inputs probed are those carrying a tangent; in a reverse pass, those that
            require grad.
        with_jvp: also run the dot-product test (the class has its own jvp and mixedad's
            forward-AD level is open).
    """
    if not _has_data((args, kwargs)):
        return _UNPROBED  # meta or fake tensors: nothing to probe with, and nothing remembered
    with _lock:
        found = _verdicts.get(cls)
    if found is None or (with_jvp and not found.jvp_tested):
        found = _probe(apply, args, kwargs, with_jvp, jvp or apply)
        with _lock:
            _verdicts[cls] = found
    return found


def verdict_in_batch(batch, key, apply, args, kwargs, *, with_jvp, jvp=None):
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
        return verdict(key, apply, call_args, call_kwargs, with_jvp=with_jvp, jvp=jvp)


def verdict_under_transforms(cls, apply, args, kwargs):
    """:func:`verdict` inside torch.func transforms (a vmap over codes): probed outside them, on plain examples.

    Each tensor of the transforms is replaced by its first example (:func:`plain_example`); those
    with a floating dtype carry a tangent for the probes. A class probed before keeps its verdict.
    """
    leaves, spec = tree_flatten((args, kwargs))
    wrapped = [isinstance(t, torch.Tensor) and is_wrapped(t) for t in leaves]
    plain = [plain_example(t) if w else t for t, w in zip(leaves, wrapped)]
    with TangentBatch.plain():
        probe = [dual(t, torch.zeros_like(t)) if w and t.is_floating_point() else t for t, w in zip(plain, wrapped)]
        call_args, call_kwargs = tree_unflatten(probe, spec)
        return verdict(cls, apply, call_args, call_kwargs, with_jvp=has_own_jvp(cls))


def _has_data(tree):
    """Whether the tensors in ``tree`` hold values (not meta tensors, not fake tensors)."""
    return not any(isinstance(t, torch.Tensor) and not holds_values(t) for t in tree_flatten(tree)[0])


def _carries_derivative(leaf):
    """Whether an input takes part in the derivative: a tangent at mixedad's level, or requires_grad."""
    if dual_level_open():
        return unpack(leaf)[1] is not None
    return leaf.requires_grad


def _tolerance(dtype):
    return TOLERANCE.get(dtype, 1e-2)


def _close(lhs, rhs, scale, dtype):
    return abs(lhs - rhs) <= _tolerance(dtype) * scale + torch.finfo(dtype).tiny


def _probe(apply, args, kwargs, with_jvp, jvp):
    leaves, spec = tree_flatten((args, kwargs))
    work, bases, positions = list(leaves), [], []
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided:
            continue
        primal = unpack(leaf)[0] if dual_level_open() else leaf
        if _carries_derivative(leaf) and primal.is_floating_point():
            base = primal.detach().requires_grad_()
            bases.append(base)
            positions.append(i)
            work[i] = base.clone()  # a non-leaf copy: the Function may write into it (mark_dirty)
        else:
            work[i] = primal.detach().clone()
    if not bases:
        return _UNPROBED
    rng = RngState()
    try:
        with torch.enable_grad():
            call_args, call_kwargs = tree_unflatten(work, spec)
            out_leaves = tree_flatten(apply(*call_args, **call_kwargs))[0]
    except Exception:  # noqa: BLE001 - the real call will raise it again, with its own context
        return _UNPROBED
    finally:
        rng.restore()
    live = [j for j, o in enumerate(out_leaves)
            if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]
    if not live:
        return _UNPROBED
    outs = [out_leaves[j] for j in live]
    dtype = outs[0].dtype
    generator = torch.Generator(device=outs[0].device).manual_seed(0)

    def rand(like, scale=1.0):
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
        scale = (_A * p).abs().max().item() + (-_B * q).abs().max().item()
        if not _close(m.sub(expected).abs().max().item(), 0.0, scale, dtype):
            return Verdict(False, True)
    if not with_jvp:
        return Verdict(True, True, jvp_tested=False)
    return Verdict(True, *_dot_product_test(jvp, leaves, spec, positions, bases, live, u1, b1, rand, dtype))


def _dot_product_test(apply, leaves, spec, positions, bases, live, us, pulled, rand, dtype):
    """(agrees, (<jvp(t), u>, <t, B(u)>)) for random t, at the open forward-AD level."""
    ts = [rand(b) for b in bases]
    work = [leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    for i, b, t in zip(positions, bases, ts):
        work[i] = dual(b.detach().clone(), t.clone())  # the jvp may write into its tangent
    rng = RngState()
    try:
        with torch.no_grad():
            call_args, call_kwargs = tree_unflatten(work, spec)
            out_leaves = tree_flatten(apply(*call_args, **call_kwargs))[0]
    except Exception:  # noqa: BLE001 - no verdict on the jvp; the real call will show its error
        return True, None
    finally:
        rng.restore()
    pushed = [unpack(out_leaves[j])[1] for j in live]
    lhs = sum(0.0 if p is None else (p * u).sum().item() for p, u in zip(pushed, us))
    rhs = sum((t * g).sum().item() for t, g in zip(ts, pulled))
    scale = (sum(0.0 if p is None else (p * u).abs().sum().item() for p, u in zip(pushed, us))
             + sum((t * g).abs().sum().item() for t, g in zip(ts, pulled)))
    return _close(lhs, rhs, scale, dtype), (lhs, rhs)


# The handlers of Function.apply (mixedad._hooks.function_apply routes each call to the pass's).

_WARNED_JVP = weakref.WeakSet()


def warn_disagreement(call, what, pushed, numbers, fix):
    """Warn that ``what`` (a jvp, a user's rule) fails the dot-product test against the backward."""
    lhs, rhs = numbers
    warnings.warn(
        f"{call}: {what} disagrees with the backward: the dot-product test on random t, u gives "
        f"<{pushed}(t), u> = {lhs:.6g} but <t, backward(u)> = {rhs:.6g}. Reverse mode is the meaning, "
        f"so mixedad differentiates the backward instead (the local double-VJP rule). {fix}",
        RuntimeWarning, stacklevel=3)


def _warn_jvp_disagrees(call, cls, numbers):
    warn_disagreement(call, f"{cls.__qualname__}.jvp", "jvp", numbers, "Fix the jvp, or remove it.")


def forward_pass_custom_function(rules, cls, args, kwargs):
    """The forward pass's dispatch for ``cls.apply(*args, **kwargs)``, a custom autograd.Function.

    A Function called with grad disabled is a constant. Otherwise the first call of each class
    probes its backward: one that is not linear in its incoming gradient sends all of G to the
    whole-G fallback at double backward's own cotangent; a ``jvp`` that fails the dot-product
    test against the backward is not trusted (a warning, then the local rule); a Function
    without ``jvp`` takes the local rule. ``rules`` is the pass's :class:`~mixedad.op_rules.OpRules`.
    """
    if cls is CheckpointFunction:
        if rules.recorder is not None:
            rules.recorder.add("torch.utils.checkpoint (reentrant)", Path.FORWARD, "run directly: no recomputation needed")
        return run_directly(args)
    with unwatched():  # threads a Function starts inside its forward are its own business
        return _forward_pass_custom_function(rules, cls, args, kwargs)


def _forward_pass_custom_function(rules, cls, args, kwargs):
    name = f"{cls.__qualname__} (custom Function)"
    apply = functools.partial(original_apply, cls)
    batch = rules.batch if rules.in_batch() else None
    if batch is not None:
        return _batched_custom_function(rules, batch, cls, name, apply, args, kwargs)
    if not torch.is_grad_enabled():  # G turned grad off here: a constant, as in reverse mode
        return run_as_constant(apply, args, kwargs)
    if not any_tangent((args, kwargs)):
        with no_graph():
            return apply(*args, **kwargs)
    own_jvp = has_own_jvp(cls)
    with popped(rules), direct():  # the probes run the op plainly, as __torch_function__ runs ops
        found = verdict(cls, apply, args, kwargs, with_jvp=own_jvp)
    _check_linear(found, name)
    if own_jvp and not found.jvp_agrees and cls not in _WARNED_JVP:
        _WARNED_JVP.add(cls)
        _warn_jvp_disagrees(rules.call, cls, found.numbers)
    if not own_jvp or not found.jvp_agrees:
        return _local(rules, name, apply, args, kwargs, "custom Function without jvp" if not own_jvp
                      else "its jvp disagrees with its backward")
    with no_graph():
        result = apply(*args, **kwargs)
    if rules.recorder is not None and any_tangent(result):
        rules.recorder.add(name, Path.FORWARD, "its own jvp")
    return result


def _check_linear(found, name):
    if not found.linear:
        raise NeedsWholeG(f"{name} has a backward that is not linear in its incoming gradient (gradient "
                          f"clipping or normalisation?), and only double backward's own cotangent gives "
                          f"its derivative", at_cotangent=True)


def _local(rules, name, apply, args, kwargs, reason, batch=None):
    """The Function on the local rule, recorded with ``reason``."""
    if not rules.local:
        raise NeedsWholeG(f"{name} has no jvp, and the local rule is skipped")
    with popped(rules), no_graph(), direct():  # the op runs plainly, as inside __torch_function__
        result = local_jvp(rules.call, name, apply, args, kwargs, custom=True, batch=batch)
    if rules.recorder is not None:
        rules.recorder.add(name, Path.LOCAL, reason)
    return result


def _batched_custom_function(rules, batch, cls, name, apply, args, kwargs):
    """A custom Function in a pass with a batch of tangents: run outside torch.func, on plain tensors.

    torch.func runs a Function only with ``setup_context`` (and a ``jvp`` and a vmap rule to batch
    its tangent); mixedad needs neither. The Function runs once on the plain primals, and its
    backward is differentiated once per tangent (the local rule). A Function with its own jvp
    takes the local rule here too: its jvp is only ever trusted where it agrees with the
    backward, and the backward is the meaning.
    """
    if not torch.is_grad_enabled() or not any_tangent((args, kwargs)):  # a constant
        leaves, spec = tree_flatten((args, kwargs))
        plain = [batch.lower_primal(unpack(t)[0]) if isinstance(t, torch.Tensor) and t.layout == torch.strided
                 else t for t in leaves]
        with popped(rules), direct(), batch.plain(), torch.no_grad():
            plain = [t.detach() if isinstance(t, torch.Tensor) else t for t in plain]
            call_args, call_kwargs = tree_unflatten(plain, spec)
            return apply(*call_args, **call_kwargs)
    with popped(rules), direct():
        found = verdict_in_batch(batch, cls, apply, args, kwargs, with_jvp=False)
    _check_linear(found, name)
    try:
        return _local(rules, name, apply, args, kwargs, "custom Function, batched tangents" if has_own_jvp(cls)
                      else "custom Function without jvp", batch=batch)
    except OpRuleError as error:
        if not has_own_jvp(cls):
            raise
        raise UnderTransformError(f"{rules.call}: {name} has a jvp but a backward that cannot be differentiated, "
                                  f"so a batch of tangents cannot go through it in one pass") from error


class CheckpointsRunDirectly:
    """``Function.apply`` handler for reverse passes: reentrant checkpoints run directly.

    A reentrant checkpoint refuses ``torch.autograd.grad``; run directly, the block records an
    ordinary graph (the reverse passes keep G's graph anyway). Other Functions are untouched.
    """

    def custom_function(self, cls, args, kwargs):
        if cls is CheckpointFunction:
            return run_directly(args)
        return original_apply(cls, *args, **kwargs)


class FunctionsUnderTransforms:
    """``Function.apply`` handler for passes under torch.func transforms (a vmap over codes and tangents).

    torch.func runs a custom Function only if it defines ``setup_context``, and pushes a tangent
    through it only with its own ``jvp``; the op rules step aside there. A Function that lacks
    either gets a mixedad error that names it and says what to do, instead of torch.func's.
    """

    under_transforms = True

    def __init__(self, call, grad_mode=None):
        self.call = call
        self.grad_mode = grad_mode  # the pass's ReadGradMode, stepped out of while the probes run

    def custom_function(self, cls, args, kwargs):
        needs = [("setup_context", has_setup_context(cls)), ("jvp", has_own_jvp(cls))]
        if under_vmap():
            needs.append(("vmap (or generate_vmap_rule = True)", cls.generate_vmap_rule or has_own_vmap(cls)))
        missing = [what for what, ok in needs if not ok]
        if not missing and cls is not CheckpointFunction and torch.is_grad_enabled():
            with popped(self.grad_mode) if self.grad_mode is not None else contextlib.nullcontext(), direct():
                found = verdict_under_transforms(cls, functools.partial(original_apply, cls), args, kwargs)
            name = f"{cls.__qualname__} (custom Function)"
            if not found.linear:
                raise FunctionUnderTransformError(
                    f"{self.call}: {name} has a backward that is not linear in its incoming gradient (gradient clipping "
                    f"or normalisation?), so only double backward's own cotangent gives its derivative, and torch.func "
                    f"would use its jvp instead. Call mixed_grad once per tangent (mixed_jacobian does that by itself).")
            if not found.jvp_agrees:
                lhs, rhs = found.numbers
                raise FunctionUnderTransformError(
                    f"{self.call}: {cls.__qualname__}.jvp disagrees with the backward (the dot-product test gives "
                    f"{lhs:.6g} against {rhs:.6g}), and torch.func would use the jvp. Reverse mode is the meaning: fix "
                    f"the jvp, or call mixed_grad once per tangent, where mixedad differentiates the backward.")
        if missing and cls is not CheckpointFunction:
            raise FunctionUnderTransformError(
                f"{self.call}: G calls the custom autograd.Function {cls.__qualname__} inside a torch.func "
                f"transform (vmap over mixed_grad, or a batched pass), and torch.func can only push "
                f"tangents through a Function that defines {' and '.join(missing)}. Give it "
                f"{' and '.join(missing)}, or call mixed_grad once per tangent (mixed_jacobian does "
                f"that by itself), where mixedad's per-op rules take it."
            )
        return original_apply(cls, *args, **kwargs)


#: Torch functions that make G's backward depend on its cotangent: gradient hooks.
GRADIENT_HOOKS = (torch.Tensor.register_hook,)


class ReverseMode(CheckpointsRunDirectly, TorchFunctionMode):
    """The whole-G fallback's watch on G: what makes its backward depend on the cotangent.

    Use it as a mode and as the ``Function.apply`` handler of the pass. ``at_cotangent``
    becomes True when G registers a gradient hook, holds a module with backward hooks, or calls
    a custom Function whose backward fails the linearity probe: the double VJP must then be
    evaluated at double backward's own cotangent, not at u = 1.
    """

    def __init__(self):
        super().__init__()
        self.at_cotangent = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in GRADIENT_HOOKS:
            self.at_cotangent = True
        return func(*args, **(kwargs or {}))

    def custom_function(self, cls, args, kwargs):
        if cls is BackwardHookFunction:  # a module's full backward hooks
            self.at_cotangent = True
        elif cls is not CheckpointFunction and torch.is_grad_enabled() and _requires_grad((args, kwargs)):
            with popped(self):
                found = verdict(cls, functools.partial(original_apply, cls), args, kwargs, with_jvp=False)
            self.at_cotangent = self.at_cotangent or not found.linear
        return super().custom_function(cls, args, kwargs)


def _requires_grad(tree):
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(tree)[0])
