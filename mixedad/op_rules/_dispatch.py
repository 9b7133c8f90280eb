"""The dispatch of mixedad's per-op pass: each op of G that receives a tangent, sent to its path.

:class:`OpRules` is the torch-function mode of a pass (custom ``autograd.Function``\\ s come to
it through :meth:`OpRules.custom_function`); :class:`PathRecorder` counts which op took which
path, for :func:`mixedad.tangent_report`; :func:`skipping` keeps a thread's passes off paths. The
paths and the table of rules are described in :mod:`mixedad.op_rules`.
"""
import contextlib
import functools
import threading
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

import torch
from torch.overrides import TorchFunctionMode

from mixedad._ground.watch import note_generators
from mixedad._ground.naming import op_name
from mixedad._ground.grad_mode import (GRAD_MODE_SETTERS, GRAPH_ATTRIBUTES, REQUIRES_GRAD, cannot_batch, no_graph,
                                         run_as_constant)
from mixedad._hooks.composites import COMPOSITES, CompositeReentered, run_inside
from mixedad._hooks.dual_level import any_tangent, any_tangent_in
from mixedad._hooks.function_apply import original_apply
from mixedad._hooks.functorch import TangentBatch, in_functorch_transform
from mixedad._hooks.library_ops import is_library_op
from mixedad._hooks.torch_function_stack import popped
from mixedad.op_rules import _attention, _formulas, _frozen_layers, _rnn  # noqa: F401  (they register their rules)
from mixedad.op_rules._custom_functions import GRADIENT_HOOKS, forward_pass_custom_function
from mixedad._ground.errors import NeedsWholeG, OpRuleError, RestartPass, UnderTransformError
from mixedad.op_rules._local import FAILED, LIBRARY_OP_RULE, SILENTLY_WRONG, failed_rule, remember_failure
from mixedad.op_rules._table import TABLE, OpCall, Path, Rule, pack

__all__ = ["OpRules", "PathRecorder", "skipping", "skipped_paths", "op_name", "untrusted_under_transforms", "PATHS",
           "SKIPPABLE", "REVERSE_MODE_INSIDE"]

FROZEN, ATTENTION, FORMULA, USER, LOCAL, FORWARD, WHOLE_G = Path
#: Every path, in the order the report lists them.
PATHS = tuple(Path)
#: The paths a pass can be told not to take (:func:`skipping`, ``OpRules(skip=...)``).
SKIPPABLE = (Path.FROZEN, Path.ATTENTION, Path.FORMULA, Path.USER, Path.LOCAL)

#: Torch functions that need G's reverse graph: G differentiates inside itself, or changes its
#: own gradients with a hook (which forward mode never runs). All of G then takes the whole-G
#: fallback; for hooks at double backward's own cotangent, since a hook need not be linear.
REVERSE_MODE_INSIDE = {
    torch.autograd.grad: "G calls torch.autograd.grad inside itself",
    torch.autograd.backward: "G calls torch.autograd.backward inside itself",
    torch.Tensor.backward: "G calls Tensor.backward inside itself",
    torch.Tensor.register_hook: "G registers a gradient hook (Tensor.register_hook), which forward mode never runs",
}


_settings = threading.local()


@contextlib.contextmanager
def skipping(*paths: Union[Path, str]) -> Iterator[None]:
    """Passes started in this thread inside the block do not take ``paths`` (benchmarks use it).

    ``skipping(LOCAL, FORMULA)`` gives mixedad as it was before per-op rules: an op forward mode
    cannot take sends all of G to the whole-G fallback.
    """
    unknown = [p for p in paths if p not in SKIPPABLE]
    if unknown:
        raise ValueError(f"skipping(*paths): expected paths from {[str(p) for p in SKIPPABLE]}, got {unknown}.")
    previous = getattr(_settings, "skip", ())
    _settings.skip = tuple(previous) + tuple(Path(p) for p in paths)
    try:
        yield
    finally:
        _settings.skip = previous


def skipped_paths() -> Tuple[Path, ...]:
    """The paths that :func:`skipping` keeps passes of this thread from taking now (empty outside it)."""
    return tuple(getattr(_settings, "skip", ()))


def untrusted_under_transforms(func: Any) -> Optional[str]:
    """Why PyTorch's own formula cannot be trusted for ``func`` inside a torch.func transform, or None.

    The op rules step aside inside torch.func transforms other than mixedad's own batch of
    tangents (a vmap over codes around mixed_grad), where PyTorch's formula runs instead. That is right for the rules that only save
    memory or time, but not for an op whose formula PyTorch gets silently wrong, an op of a
    library namespace (whose tangent PyTorch may drop), or an op the user gave a rule: those are
    refused there, naming the op.
    """
    rule = TABLE.get(func)
    if rule is not None and rule.path is Path.USER:
        return f"{op_name(func)} has a rule registered with mixedad.op_rules.register, which torch.func does not run"
    if func in SILENTLY_WRONG:
        return f"PyTorch's forward-AD formula for {op_name(func)} is wrong ({SILENTLY_WRONG[func]})"
    if is_library_op(func):
        return f"{op_name(func)} is a library op, whose tangent PyTorch's forward mode may drop"
    return None


class OpRules(TorchFunctionMode):
    """The dispatch: inside mixedad's forward-AD pass, sends each op to its path.

    Args:
        call: the public call's name, for messages.
        recorder: None, or a :class:`PathRecorder` that counts which op took which path.
        skip: keyword-only; paths not to take (``FROZEN``, ``ATTENTION``, ``FORMULA``, ``USER``,
            ``LOCAL``), for benchmarks and the zoo's calibration. Ops then take PyTorch's formula,
            and without ``LOCAL`` an op whose formula is missing sends G to the whole-G fallback.
        batch: keyword-only; the :class:`~mixedad._hooks.functorch.TangentBatch` of a pass with
            many tangents (:mod:`mixedad._frontend.batched`), or None. The rules then run inside
            that batch's torch.func transforms; rules registered with ``batched=True`` see plain
            tensors with the tangents as a leading dimension.
    """

    def __init__(self, call: str, recorder: Optional["PathRecorder"] = None, *,
                 skip: Optional[Sequence[Union[Path, str]]] = None, batch: Optional[TangentBatch] = None) -> None:
        super().__init__()
        self.call, self.recorder, self.batch = call, recorder, batch
        skip = tuple(Path(p) for p in (getattr(_settings, "skip", ()) if skip is None else skip))
        self.local = Path.LOCAL not in skip
        self.attention = Path.ATTENTION not in skip
        self.skip = skip
        self.failed = FAILED if self.local else {}
        #: The pass's :class:`~mixedad._ground.inputs.PassInputs` (set by the pass): ops about to write into the
        #: caller's z or v restart it on copies.
        self.inputs: Any = None
        self._rules: Dict[Any, Optional[Rule]] = {}  # func -> its rule in this pass (TABLE and the skips do not change during one)
        _frozen_layers.forget_folds()  # a fold that a pass stopped early left behind (see _frozen_layers._fold)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        note_generators(args, kwargs)
        kwargs = kwargs or {}
        if in_functorch_transform() and not self.in_batch():
            return func(*args, **kwargs)  # G runs torch.func.vmap (or another transform) inside
        if func in GRAD_MODE_SETTERS:
            return func(*args, **kwargs)
        if self.inputs is not None and not self.inputs.private:
            self.inputs.watch(func, args, kwargs, self.batch if self.in_batch() else None)
        if self.batch is not None:
            reason = cannot_batch(func, args, kwargs)
            if reason is not None:
                raise UnderTransformError(f"{self.call}: {reason}")
        if not torch.is_grad_enabled():  # G turned grad off here: a constant, as in reverse mode
            return run_as_constant(func, args, kwargs)
        if func in COMPOSITES:
            try:
                return run_inside(self, func, args, kwargs)
            except CompositeReentered as error:
                raise NeedsWholeG(f"mixedad's copy of {op_name(func)} does not fit this torch version ({error})") \
                    from error
        if func in REVERSE_MODE_INSIDE:
            raise NeedsWholeG(REVERSE_MODE_INSIDE[func], at_cotangent=func in GRADIENT_HOOKS)
        if func == REQUIRES_GRAD and any_tangent(args):
            return True  # as in reverse mode, where what depends on z requires grad
        if func in GRAPH_ATTRIBUTES and any_tangent(args):
            raise NeedsWholeG(f"G reads {GRAPH_ATTRIBUTES[func]} of a tensor that depends on z, which only a "
                              f"reverse pass has")
        with no_graph():  # tangents only: no reverse graph through G's parameters
            return self._dispatch(func, args, kwargs)

    @property
    def under_transforms(self) -> bool:
        """Whether custom Functions come to this dispatch inside torch.func (a batched pass)."""
        return self.batch is not None

    def in_batch(self) -> bool:
        """Whether an op runs at the level of this pass's tangent batch (not in a transform G runs)."""
        return self.batch is not None and self.batch.active()

    def rule_for(self, func: Any) -> Optional[Rule]:
        """The rule ``func`` takes in this pass, or None for PyTorch's formula."""
        try:
            return self._rules[func]
        except KeyError:
            pass
        except TypeError:  # an unhashable callable: looked up each time
            return self._find_rule(func)
        rule = self._rules[func] = self._find_rule(func)
        return rule

    def _find_rule(self, func):
        rule = TABLE.get(func)
        if rule is None and self.local and is_library_op(func):
            rule = LIBRARY_OP_RULE
        return None if rule is None or rule.path in self.skip else rule

    def _dispatch(self, func, args, kwargs):
        rule = self.rule_for(func)
        if rule is not None or func in self.failed:
            if rule is not None:
                result = self.apply(rule, func, args, kwargs)
                if result is not NotImplemented:
                    return result
            elif not any_tangent_in(args, kwargs):
                return func(*args, **kwargs)  # the plain call: no tangent to push
            if func in self.failed:  # its formula raised before, for these inputs: the local rule
                rule = failed_rule(func, args, kwargs)
                if rule is not None:
                    result = self.apply(rule, func, args, kwargs)
                    if result is not NotImplemented:
                        return result
        try:
            result = func(*args, **kwargs)
        except NotImplementedError as error:  # torch's type for "no forward-AD formula"
            if not any_tangent((args, kwargs)):
                raise
            if not self.local:
                raise NeedsWholeG(f"{op_name(func)} has no forward-mode AD formula here") from error
            remember_failure(func, args, kwargs, error)  # no formula: a property of the op, dtype and device
            raise RestartPass(op_name(func), error) from error
        except RuntimeError as error:
            if isinstance(error, OpRuleError) or not self.local or not any_tangent((args, kwargs)):
                raise
            if self.in_batch():
                # Under torch.func the failure may be the transform's (a batching rule it lacks, a random op in
                # the caller's vmap with randomness="error"), not the formula's: nothing is remembered, and the
                # batch steps aside (one tangent per pass, or torch.func's own pass).
                raise UnderTransformError(f"{self.call}: {op_name(func)} failed in a batch of tangents "
                                          f"({str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__})") from error
            remember_failure(func, args, kwargs, error)
            raise RestartPass(op_name(func), error) from error
        if self.recorder is not None and any_tangent(result):
            self.recorder.add(op_name(func), Path.FORWARD, "PyTorch's formula")
        return result

    def apply(self, rule: Rule, func: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any],
              name: Optional[str] = None) -> Any:
        """Run ``rule`` on this call: bind, unpack, call, pack, record. NotImplemented if it declines."""
        batch = self.batch if self.in_batch() else None
        lowered = batch if batch is not None and rule.batched else None
        op = OpCall(func, name or op_name(func), self.call, args, kwargs, rule.arguments or (), dispatch=self._reenter,
                    batch=batch, lowered=lowered is not None)
        if not op.any_tangent:
            return func(*args, **kwargs)  # the plain call: no tangent to push
        if lowered is not None:
            with lowered.plain():  # plain tensors, the tangents of the batch as a leading dimension
                result = rule.apply(op)
        else:
            result = rule.apply(op)
        if result is NotImplemented:
            return NotImplemented
        if not (isinstance(result, tuple) and len(result) == 2):
            raise OpRuleError(f"{self.call}: the tangent rule {rule.owner} for {op.name} returned "
                              f"{type(result).__name__}; a rule returns (output, output_tangent) or NotImplemented")
        value = pack(*result) if lowered is None else pack(*result, attach=lowered.lift)
        if self.recorder is not None:
            path, reason = op.rerouted or (rule.path, rule.reason)
            self.recorder.add(op.name, path, reason)
            if rule.path is Path.USER:
                self.recorder.user_rules.add(op.name)
        return value

    def _reenter(self, func, *args, **kwargs):
        """``func(*args, **kwargs)`` through this dispatch, from inside a rule (grad on, as at the rule's op)."""
        with torch.enable_grad(), self:
            return func(*args, **kwargs)

    def custom_function(self, cls: type, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        """The dispatch for ``cls.apply(*args, **kwargs)``, a custom autograd.Function."""
        if in_functorch_transform() and not self.in_batch():
            return original_apply(cls, *args, **kwargs)  # inside a transform G runs itself
        rule = TABLE.get(cls)
        if rule is not None and torch.is_grad_enabled() and any_tangent((args, kwargs)) and rule.path not in self.skip:
            with popped(self):
                result = self.apply(rule, functools.partial(original_apply, cls), args, kwargs, name=op_name(cls))
            if result is not NotImplemented:
                return result
        return forward_pass_custom_function(self, cls, args, kwargs)


class PathRecorder:
    """Counts, per op, the calls that took each path; and the whole-G fallback, if any.

    Also what a pass saw that a tangent program cannot do: ``user_rules``, the ops whose user's rule
    (:func:`register`) ran (whether it passed its check or not), and ``inputs_written``, whether G
    wrote into its inputs (the pass then ran on copies of them).
    """

    def __init__(self) -> None:
        self.counts: Dict[Tuple[str, Path, str], int] = {}
        self.fallback: Optional[str] = None
        self.user_rules: set = set()
        self.inputs_written = False

    def add(self, op: str, path: Union[Path, str], reason: str) -> None:
        key = (op, Path(path), reason)
        self.counts[key] = self.counts.get(key, 0) + 1

