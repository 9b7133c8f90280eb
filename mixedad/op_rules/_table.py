r"""The rule table in JAX's shape: one signature, one table, registration beside each rule.

A tangent rule is a function ``rule(op)`` of one :class:`OpCall`: one call of one op, its
arguments bound by name and split into primals and tangents. It returns ``(output,
output_tangent)``, where ``output_tangent`` has the structure of ``output`` and holds None where an
output leaf has no tangent; or ``(output, None)`` for an output whose leaves already carry their
tangents (a rule that re-enters the dispatch); or ``NotImplemented`` when it does not apply to this
call (the op then takes the next path: a remembered failure, then PyTorch's formula).

The dispatcher (:class:`mixedad.op_rules.OpRules`) does the common work once: it binds the
arguments, unpacks dual tensors, calls the op plainly when no argument carries a tangent, packs
the returned tangents into dual tensors, and records the path for :func:`mixedad.tangent_report`.
"""
import enum
import inspect
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from mixedad._hooks.dual_level import any_tangent, dual, split_args, split_tree
from mixedad._hooks.function_apply import has_setup_context
from mixedad._hooks.library_ops import schema_argument_names
from mixedad._hooks.pytree import tree_flatten, tree_unflatten

__all__ = ["Path", "Rule", "OpCall", "TABLE", "defrule"]


class Path(str, enum.Enum):
    """The paths an op can take in mixedad's forward pass, in the order reports list them."""

    FROZEN = "frozen layer"
    ATTENTION = "blockwise attention"
    FORMULA = "written formula"
    USER = "user rule"
    LOCAL = "local double-VJP"
    FORWARD = "forward AD"
    WHOLE_G = "whole-G fallback"

    def __str__(self):
        return self.value

    def __format__(self, spec):
        return format(self.value, spec)

    @property
    def description(self) -> str:
        """What the path does, in one sentence (the docs' path table is built from these)."""
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    Path.FROZEN: "Linear, convolution and eval-mode batch norm whose weights carry no tangent: one plain call "
                 "for the primal and one for the tangent.",
    Path.ATTENTION: "Scaled dot-product attention: the user's fused kernel for the primal, the tangent a block "
                    "of queries at a time, never the whole T x T matrix.",
    Path.FORMULA: "Ops whose PyTorch formula is missing or unusable, with the tangent written out; fused "
                  "multi-layer RNNs split into one call per layer.",
    Path.USER: "A rule the user registered with mixedad.op_rules.register, checked against the op's backward "
               "on each new signature (which arguments carry tangents, their dtypes).",
    Path.LOCAL: "The op's tangent by two reverse passes through that op alone: ops with no, a wrong or a raising "
                "formula, custom Functions without jvp, library ops.",
    Path.FORWARD: "PyTorch's own forward-AD formula; a custom Function's own jvp.",
    Path.WHOLE_G: "The last resort: two reverse passes through all of G. Memory grows with G's depth; it warns.",
}


class OpCall:
    """One call of one op, as a tangent rule sees it.

    Attributes:
        func: the op (a torch function, an ``OpOverload``, or a custom Function's ``apply``).
        name: its readable name, for messages and reports.
        call: the public call's name (``"mixed_grad(f, G, z, y)"``), for messages.
        args, kwargs: the call as G made it, dual tensors included.
        primals: the arguments by name (positional ones named by the rule's ``arguments``),
            tensors replaced by their primals; nested containers keep their structure.
        tangents: the same names, each tensor replaced by its tangent or None.
        batch: None in a pass with one tangent; in a pass with a batch of tangents (``mixed_jacobian``,
            vmap over ``mixed_grad``), the :class:`~mixedad._hooks.functorch.TangentBatch`. Tangents
            are then torch.func's batched tensors: ordinary torch code on them computes every
            tangent of the batch at once; a rule that needs plain tensors lowers them with it.
    """

    def __init__(self, func: Callable[..., Any], name: str, call: str, args: Sequence[Any], kwargs: Dict[str, Any],
                 names: Sequence[str] = (), dispatch: Optional[Callable[..., Any]] = None,
                 batch: Any = None, lowered: bool = False) -> None:
        self.func, self.name, self.call, self.args, self.kwargs = func, name, call, args, kwargs
        self.batch = batch
        #: Whether primals are plain tensors and tangents carry a leading tangent dimension
        #: (a rule registered with ``batched=True``, in a batched pass).
        self.lowered = lowered
        self._names = tuple(names)
        self._dispatch = dispatch
        self.rerouted: Optional[Tuple[Path, str]] = None
        self._primal_args, tangent_args = split_args(args)
        self._primal_kwargs, tangent_kwargs = split_tree(kwargs) if kwargs else ({}, {})
        if lowered:
            self._primal_args, tangent_args = lower_tree(batch, self._primal_args, tangent_args)
            if kwargs:
                self._primal_kwargs, tangent_kwargs = lower_tree(batch, self._primal_kwargs, tangent_kwargs)
        #: Whether any argument carries a tangent (the dispatcher makes the plain call if not).
        self.any_tangent = any_tangent(tangent_args, tangents=True) or (
            bool(kwargs) and any_tangent(tangent_kwargs, tangents=True))
        self.primals = self._by_name(self._primal_args, self._primal_kwargs)
        self.tangents = self._by_name(tangent_args, tangent_kwargs)

    def _by_name(self, args, kwargs):
        named = _Arguments(self.name)
        named.update({(self._names[i] if i < len(self._names) else f"arg{i}"): a for i, a in enumerate(args)})
        named.update(kwargs)
        return named

    def primal(self, **overrides: Any) -> Any:
        """The op called plainly on the primals, with arguments replaced by name (``bias=None``)."""
        args = list(self._primal_args)
        kwargs = dict(self._primal_kwargs)
        for key, value in overrides.items():
            position = self._names.index(key) if key in self._names else -1
            if 0 <= position < len(args):
                args[position] = value
            else:
                kwargs[key] = value
        return self.func(*args, **kwargs)

    def reroute(self, path: Union[Path, str], reason: str) -> None:
        """Record that this call took ``path`` instead of the rule's own (attention with dropout)."""
        self.rerouted = (Path(path), reason)

    def dispatch(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``func(*args, **kwargs)`` through mixedad's dispatch again, so that call takes its own path."""
        if self._dispatch is None:
            raise RuntimeError(f"{self.name}: this rule cannot re-enter the dispatch here")
        return self._dispatch(func, *args, **kwargs)


class _Arguments(dict):
    """A call's arguments by name; a missing name says which names there are."""

    def __init__(self, op_name):
        super().__init__()
        self.op_name = op_name

    def __missing__(self, key):
        raise KeyError(f"{self.op_name} has no argument {key!r} in this call; its arguments here are named "
                       f"{sorted(self)}. Positional arguments of builtins are named arg0, arg1, ... unless the rule "
                       f"is registered with arguments=(...).")


def lower_tree(batch, primals, tangents):
    """``(primals, tangents)`` of a batched pass as plain tensors, tangents with a leading dimension k.

    ``primals`` and ``tangents`` have one structure, as :func:`mixedad._hooks.dual_level.split_tree`
    and ``split_args`` give them: ``tangents`` holds None for a leaf or a whole container without
    a tangent.
    """
    if isinstance(primals, torch.Tensor):
        plain = batch.lower_primal(primals)
        return plain, None if tangents is None else batch.lower_tangent(tangents, plain)
    if tangents is None:
        leaves, spec = tree_flatten(primals)
        return tree_unflatten([batch.lower_primal(t) if isinstance(t, torch.Tensor) else t for t in leaves], spec), None
    if isinstance(primals, dict):
        named = {key: lower_tree(batch, value, tangents[key]) for key, value in primals.items()}
        return {k: p for k, (p, _) in named.items()}, {k: t for k, (_, t) in named.items()}
    parts = [lower_tree(batch, p, t) for p, t in zip(primals, tangents)]
    kind = list if isinstance(primals, list) else tuple
    return kind(p for p, _ in parts), kind(t for _, t in parts)


def pack(output, tangent, attach=dual):
    """``output`` with ``tangent`` attached leaf by leaf (None: the leaf stays as it is).

    ``attach(primal, tangent)`` makes each dual tensor (a batched pass lifts plain tensors).
    """
    if tangent is None:
        return output
    if isinstance(output, torch.Tensor):
        return attach(output, tangent)
    out_leaves, spec = tree_flatten(output)
    tangent_leaves = tree_flatten(tangent, is_leaf=lambda x: x is None)[0]
    if len(tangent_leaves) != len(out_leaves):
        raise ValueError(f"a tangent rule returned {len(tangent_leaves)} tangents for {len(out_leaves)} outputs")
    return tree_unflatten([o if t is None else attach(o, t) for o, t in zip(out_leaves, tangent_leaves)], spec)


class Rule(NamedTuple):
    """One path for one op.

    Attributes:
        path: the :class:`Path` it takes.
        apply: ``apply(op: OpCall)``, returning ``(output, output_tangent)`` or NotImplemented.
        reason: why the op takes this path, for reports.
        arguments: the names of the op's positional arguments, in order, or None.
        owner: who wrote it: ``"mixedad"``, or the user's function's qualified name.
        batched: whether the rule takes a batch of tangents as a leading dimension: in a batched
            pass it then sees plain primals and tangents of shape ``(k, *primal.shape)``, runs
            outside torch.func, and returns tangents of that shape. Other rules run on torch.func's
            batched tensors as they are.
    """

    path: Path
    apply: Callable[[OpCall], Any]
    reason: str
    arguments: Optional[Tuple[str, ...]] = None
    owner: str = "mixedad"
    batched: bool = False


#: The one table: op -> :class:`Rule`. Ops not in it take PyTorch's formula.
TABLE: Dict[Any, Rule] = {}


def defrule(path, *ops, reason, arguments=None, batched=False):
    """Register the decorated function as the rule of ``ops`` on ``path`` (mixedad's own rules)."""

    def register(apply):
        for op in ops:
            TABLE[op] = Rule(Path(path), apply, reason, arguments_of(op, arguments), batched=batched)
        return apply

    return register


def arguments_of(op, given=None):
    """The names of ``op``'s positional arguments: ``given``, or read from its schema or signature."""
    if given is not None:
        return tuple(given)
    names = schema_argument_names(op)
    if names is not None:
        return names
    target = op
    if isinstance(op, type) and issubclass(op, torch.autograd.Function):
        target = op.forward
    try:
        parameters = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: positional names arg0, arg1, ...
        return ()
    if target is not op and not _new_style(op) and parameters:
        parameters = parameters[1:]  # forward(ctx, ...)
    return tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _new_style(cls):
    return has_setup_context(cls)
