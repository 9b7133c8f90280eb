r"""Custom ``autograd.Function``\ s in mixedad's passes: the handlers of ``Function.apply``.

A Function's backward is the meaning of its derivative. The forward pass checks, on each new
signature of a class (:mod:`mixedad.op_rules._probes`), that its backward is linear in its
incoming gradient (else all of G takes the whole-G fallback at double backward's own cotangent)
and that its own ``jvp``, if it has one, agrees with the backward (else the local rule
differentiates the backward); a Function without ``jvp`` takes the local rule. The whole-G
fallback, passes under torch.func transforms and reverse passes each have a handler here too.
"""
import contextlib
import functools
import weakref

import torch
from torch.overrides import TorchFunctionMode

from mixedad._ground import watch
from mixedad._ground.grad_mode import no_graph, run_as_constant
from mixedad._hooks.checkpoint import CheckpointFunction, run_directly
from mixedad._hooks.dual_level import any_tangent, unpack
from mixedad._hooks.function_apply import direct, has_own_jvp, has_own_vmap, has_setup_context, original_apply
from mixedad._hooks.functorch import under_vmap
from mixedad._hooks.module_hooks import BackwardHookFunction
from mixedad._hooks.pytree import tree_flatten, tree_unflatten
from mixedad._hooks.threads import unwatched
from mixedad._hooks.torch_function_stack import popped
from mixedad._ground.errors import FunctionUnderTransformError, NeedsWholeG, OpRuleError, UnderTransformError
from mixedad.op_rules._local import local_jvp
from mixedad.op_rules._probes import verdict, verdict_in_batch, verdict_under_transforms, warn_disagreement
from mixedad.op_rules._table import Path

# The handlers of Function.apply (mixedad._hooks.function_apply routes each call to the pass's).

_WARNED_JVP = weakref.WeakSet()


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
    if rules.inputs is not None:  # its own jvp may write into what it takes (ctx.mark_dirty), unseen by mixedad
        rules.inputs.watch_targets(name, [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)])
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
    # The op runs plainly, as inside __torch_function__, where mixedad's dispatch does not note the generators its
    # forward draws from: the watch reads them.
    with popped(rules), watch.ops(), no_graph(), direct():
        result = local_jvp(rules.call, name, apply, args, kwargs, custom=True, batch=batch,
                           before_write=None if rules.inputs is None else functools.partial(
                               rules.inputs.watch_targets, name, batch=batch))
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
        with popped(rules), watch.ops(), direct(), batch.plain(), torch.no_grad():
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
