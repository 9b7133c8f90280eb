"""Tangent rules that users register for ops mixedad does not know: :func:`register`."""
import functools
import weakref
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch
from torch.overrides import resolve_name

from mixedad._hooks.dual_level import tangent_of
from mixedad._hooks.function_apply import has_setup_context
from mixedad._hooks.library_ops import registry_keys
from mixedad._hooks.pytree import tree_flatten
from mixedad._hooks.torch_function_stack import Calls
from mixedad._ground.errors import NeedsWholeG, OpRuleError, RestartPass, UnderTransformError
from mixedad.op_rules._probes import verdict, verdict_in_batch, warn_disagreement
from mixedad.op_rules._table import TABLE, OpCall, Path, Rule, arguments_of, pack

__all__ = ["register", "unregister"]

RuleFunction = TypeVar("RuleFunction", bound=Callable[..., Any])

_WARNED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # rule -> the failed signatures it was warned of
_REPLACED: dict = {}  # op -> mixedad's own rule that a user's rule replaced
_generation = [0]


def generation() -> int:
    """A number that changes whenever a user's rule is registered or unregistered (tangent programs are written
    for one set of rules)."""
    return _generation[0]


def register(op: Any, *, arguments: Optional[Sequence[str]] = None,
             reason: Optional[str] = None) -> Callable[[RuleFunction], RuleFunction]:
    """Give ``op`` a tangent rule that mixedad's forward pass uses in place of PyTorch's formula.

    Use it as a decorator beside the rule::

        @mixedad.op_rules.register(torch.ops.mylib.upfirdn2d)
        def upfirdn2d_tangent(op):
            out = op.primal()                                   # the op on the primals
            tangent = op.primal(x=op.tangents["x"])             # linear in x: the op on x's tangent
            return out, tangent

    Args:
        op: what G calls: a torch function (``torch.erf``, ``F.gelu``, ``torch.Tensor.erf``), an
            op of a ``torch.library`` namespace (``torch.ops.mylib.upfirdn2d``, or one overload),
            or a custom ``autograd.Function`` class you cannot edit.
        arguments: keyword-only; the names of the op's positional arguments, in order, where
            mixedad cannot read them (builtins). By default they come from the op's schema or
            signature (a Function's ``forward``, without ``ctx``).
        reason: keyword-only; a few words for :func:`mixedad.tangent_report` (default: the rule's
            qualified name).

    ``torch.erf`` and ``torch.Tensor.erf`` are two functions: register each form G calls.

    The rule is called as ``rule(op)`` with an :class:`~mixedad.op_rules.OpCall`: ``op.primals``
    and ``op.tangents`` hold the arguments by name (tangents None where an argument carries
    none), ``op.primal(**replaced)`` calls the op plainly on the primals, with some arguments
    replaced by name. It returns ``(output, output_tangent)``, the tangent with the output's
    structure (None for an output leaf without one), or ``NotImplemented`` to decline a call
    (the op then takes the path it would have taken without the rule). It is called only for
    calls where some argument carries a tangent and grad is enabled.

    Before a rule is used, mixedad checks it against the op's own backward with the
    dot-product test on random t, u: :math:`\\langle \\mathrm{rule}(t), u\\rangle = \\langle t,
    J^\\top u\\rangle`, outside its pass, once per op, pattern of arguments that carry tangents,
    and dtypes (:mod:`mixedad.op_rules._probes`). A rule that disagrees is not used: mixedad warns,
    naming the rule and both numbers, and differentiates the op's backward instead (reverse mode is
    the meaning). An op without a backward cannot be checked; its rule is then trusted.

    A rule holds wherever mixedad pushes tangents through G: a G that meets a user's rule runs on
    mixedad's per-op pass (tangent programs, and ``compile=True``, which run mixedad's own rules,
    step aside for it, the latter with a warning), in batches of tangents too; inside a
    ``torch.func`` transform of the caller's, which would run PyTorch's formula instead, the call
    is refused.

    Returns:
        A decorator that registers the rule and returns it unchanged. Registering again replaces
        the rule (mixedad's own included); :func:`unregister` removes it and brings mixedad's own
        rule back.

    Example:
        A third-party Function without ``jvp`` (mixedad would otherwise differentiate its
        backward with the local rule):

        >>> import torch, mixedad
        >>> class Softsign(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x / (1 + x.abs())
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return g / (1 + x.abs()) ** 2
        >>> @mixedad.op_rules.register(Softsign)
        ... def softsign_tangent(op):
        ...     x, dx = op.primals["x"], op.tangents["x"]
        ...     return op.primal(), dx / (1 + x.abs()) ** 2
        >>> G = lambda z: Softsign.apply(z)
        >>> z, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
        >>> mixedad.tangent_report(G, z).ops("user rule")
        ['Softsign (custom Function)']
        >>> f = lambda y, g: ((y + g) ** 3).sum()
        >>> ours = mixedad.mixed_grad(f, G, z, y, torch.ones_like(z))
        >>> reference = mixedad.reference.double_backward_mixed_grad(f, G, z, y, torch.ones_like(z))
        >>> bool(torch.allclose(ours, reference))
        True
        >>> mixedad.op_rules.unregister(Softsign)
    """
    if isinstance(op, type) and not issubclass(op, torch.autograd.Function):
        raise TypeError(f"register({op.__qualname__}): expected a torch function, a torch.library op or a custom "
                        f"autograd.Function class; {op.__qualname__} is a class but not a Function (for a module, "
                        f"register the function or Function its forward calls).")
    if not callable(op):
        raise TypeError(f"register({op!r}): expected a torch function, a torch.library op or a custom "
                        f"autograd.Function class, got {type(op).__name__}.")
    _check_reaches_the_dispatch(op)
    keys = registry_keys(op)

    def decorate(rule: RuleFunction) -> RuleFunction:
        if not callable(rule):
            raise TypeError(f"register({op!r}): expected a function rule(op), got {type(rule).__name__}.")
        owner = getattr(rule, "__qualname__", repr(rule))
        for key in keys:
            previous = TABLE.get(key)
            if previous is not None and previous.path is not Path.USER:
                _REPLACED[key] = previous  # mixedad's own rule, back on unregister
            TABLE[key] = Rule(Path.USER, _checked(rule, key), reason or owner, arguments_of(key, arguments), owner)
        _generation[0] += 1
        return rule

    return decorate


def op_name_of(func):
    return resolve_name(func) or getattr(func, "__qualname__", repr(func))


def _check_reaches_the_dispatch(op: Callable[..., Any]) -> None:
    """Refuse a Tensor operator method (``torch.Tensor.__mul__``) that reaches mixedad's dispatch under another
    name (``a * b`` arrives as ``torch.Tensor.mul``): a rule for it would never run. Found by calling it once on
    small tensors."""
    name = getattr(op, "__name__", "")
    method: Any = getattr(torch.Tensor, name, None)
    if not name.startswith("__") or method is not op:
        return
    seen, one = Calls(), torch.ones(2)
    for args in ((one, one), (one,)):
        try:
            with seen:
                op(*args)
        except Exception:  # noqa: BLE001 - the other arity
            pass
        if seen.funcs:
            break
    if seen.funcs and op not in seen.funcs:
        arrives = op_name_of(seen.funcs[0])
        raise TypeError(f"register(torch.Tensor.{name}): G's operator reaches mixedad as {arrives}, never as "
                        f"torch.Tensor.{name}, so this rule would never run; register {arrives} (and the function "
                        f"form G calls too, such as torch.mul).")


def unregister(op: Any) -> None:
    """Remove the rule registered for ``op``; mixedad's own rule for it, if it had one, comes back."""
    for key in registry_keys(op):
        rule = TABLE.get(key)
        if rule is None or rule.path is not Path.USER:
            continue
        if key in _REPLACED:
            TABLE[key] = _REPLACED.pop(key)
        else:
            del TABLE[key]
        _generation[0] += 1


def _checked(rule, key):
    """``rule`` for the op ``key``, checked against the op's backward before its result is used."""

    @functools.wraps(rule)
    def apply(op):
        found = _check(rule, key, op)  # probed once per op, arguments with tangents and dtypes, then remembered
        if not found.jvp_agrees:
            _warn(rule, op, found)
            from mixedad.op_rules._local import local_rule

            op.reroute(Path.LOCAL, f"the user's rule {rule.__qualname__} disagrees with the op's backward")
            return local_rule(op)
        if op.batch is not None and isinstance(key, type) and not has_setup_context(key):
            raise UnderTransformError(f"{op.call}: the rule {rule.__qualname__} registered for {op.name} calls a "
                                      f"custom Function without setup_context, which torch.func cannot run in a "
                                      f"batch of tangents")
        return _result(rule, op)

    return apply


def _result(rule, op):
    """``rule(op)``, checked to be what a rule returns: its own exceptions, and tangents unlike their outputs, are
    mixedad errors that name the rule (mixedad's signals pass)."""
    what = f"{op.call}: the tangent rule {rule.__qualname__} registered for {op.name}"
    try:
        result = rule(op)
    except (OpRuleError, NeedsWholeG, RestartPass):
        raise
    except Exception as error:  # noqa: BLE001 - the user's rule failed: say whose
        text = str(error).strip()
        raise OpRuleError(f"{what} raised {type(error).__name__}{': ' + text.splitlines()[0] if text else ''}.") \
            from error
    if result is NotImplemented or not (isinstance(result, tuple) and len(result) == 2) or result[1] is None:
        return result  # declined, or malformed (the dispatch says so), or no tangent
    outputs = tree_flatten(result[0])[0]
    tangents = tree_flatten(result[1], is_leaf=lambda x: x is None)[0]
    for out, tangent in zip(outputs, tangents):
        if tangent is None or not isinstance(out, torch.Tensor):
            continue
        if tangent_of(out) is not None or tangent_of(tangent) is not None:
            raise OpRuleError(f"{what} returned an {'output' if tangent_of(out) is not None else 'tangent'} that "
                              f"carries a tangent of its own: it was computed from op.args, which hold G's dual "
                              f"tensors; compute the output with op.primal() and the tangent from op.primals and "
                              f"op.tangents.")
        shape = (op.batch.size, *out.shape) if op.lowered else tuple(out.shape)
        if not isinstance(tangent, torch.Tensor) or tuple(tangent.shape) != shape or tangent.dtype != out.dtype:
            got = (f"a {type(tangent).__name__}" if not isinstance(tangent, torch.Tensor) else
                   f"a tangent of shape {tuple(tangent.shape)} and dtype {tangent.dtype}")
            raise OpRuleError(f"{what} returned {got} for an output of shape {tuple(out.shape)} and dtype "
                              f"{out.dtype}; a tangent is a tensor of its output's shape{' (after the batch)' if op.lowered else ''} "
                              f"and dtype.")
    return result


def _check(rule, key, op):
    """The dot-product test of ``rule`` against the op's backward, on this call's arguments."""

    def pushed(*args, **kwargs):  # the rule on the probe's inputs, held to what a rule returns
        result = _result(rule, OpCall(op.func, op.name, op.call, args, kwargs, op._names))
        return NotImplemented if result is NotImplemented else pack(*result)

    if op.batch is not None:
        return verdict_in_batch(op.batch, rule, op.func, op.args, op.kwargs, with_jvp=True, jvp=pushed, op=key)
    return verdict(rule, op.func, op.args, op.kwargs, with_jvp=True, jvp=pushed, op=key)


def _warn(rule, op, found):
    warned = _WARNED.setdefault(rule, set())
    if found in warned:
        return
    warned.add(found)
    warn_disagreement(op.call, f"the tangent rule {rule.__qualname__} registered for {op.name}", "rule",
                      found.numbers, "Fix the rule, or unregister it.")
