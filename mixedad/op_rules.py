r"""Per-op tangent rules: what happens to each op of G in mixedad's forward pass.

mixedad pushes :math:`\dot g = J_G(z)\, v` through G one op at a time. Every op that receives a
tangent takes one of these paths, decided by one dispatch (:meth:`OpRules.__torch_function__`
for torch functions, :meth:`OpRules.custom_function` for custom ``autograd.Function``\ s):

=====================  ======================================================================
path                   used for
=====================  ======================================================================
``frozen layer``       ``F.linear``, ``F.conv{1,2,3}d``, ``F.conv_transpose{1,2,3}d`` and
                       eval-mode ``F.batch_norm`` whose weights carry no tangent: one plain
                       call for the primal, one for the tangent (:mod:`mixedad._frozen_layers`)
``blockwise attention`` ``F.scaled_dot_product_attention``: the user's fused kernel for the
                       primal, the tangent a block of queries at a time, never the whole
                       :math:`T \times T` matrix (:mod:`mixedad._attention`)
``written formula``    ``torch.cdist`` and ``F.group_norm``, whose PyTorch formulas are missing
                       or raise on channels-last input (:mod:`mixedad._formulas`); fused
                       multi-layer ``nn.LSTM``/``GRU``/``RNN`` calls, split into one call per
                       layer that goes through this dispatch again (:mod:`mixedad._rnn`)
``local double-VJP``   ops in :data:`KNOWN_WRONG`, :data:`DROPS_TANGENT` and :data:`NO_FORMULA`,
                       custom Functions
                       without ``jvp``, and any op whose forward-AD formula raises:
                       :math:`J_{op} v = \partial_u \langle J_{op}^\top u, v\rangle` for that op
                       alone (:mod:`mixedad._local_rule`)
``forward AD``         everything else: PyTorch's own formula; custom Functions with ``jvp``
``whole-G fallback``   the last resort, in :mod:`mixedad.tangents`: two reverse passes through
                       all of G. Memory grows with G's depth; it always warns
=====================  ======================================================================

The first four keep memory flat in G's depth. An op whose formula raises is found at run time:
the pass stops, G's random state and buffers are restored, the op is remembered (an op without
a formula per dtype and device of its floating-point inputs; another failure per input
signature: dtypes, shapes, strides) and the pass starts again, with that op on the local rule
from then on. A reentrant ``torch.utils.checkpoint`` block runs directly: mixedad's pass builds
no reverse graph through G, so there is nothing to recompute.

Only calls that pass through ``__torch_function__`` are seen. Ops inside a torch function that
has been let through run there as plain ops, except inside the Python composites of
:data:`mixedad._composites.COMPOSITES` (``F.multi_head_attention_forward``, which
``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` call), whose bodies run with the
dispatch active, so their projections take the frozen-layer rule and their attention the
attention rule.
:func:`mixedad.tangent_report` shows, for a given G and z, which op took which path.
"""
import contextlib
import functools
import threading
import warnings
import weakref
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import Function, _SingleLevelFunction
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily, resolve_name
from torch.utils.checkpoint import CheckpointFunction
from torch.nn.modules._functions import BackwardHookFunction

from mixedad._attention import Rerouted, sdpa_rule
from mixedad._composites import COMPOSITES, run_inside
from mixedad._double_vjp import OpRuleError
from mixedad._duals import any_tangent
from mixedad._formulas import cdist_rule, group_norm_rule
from mixedad._frozen_layers import WEIGHTED, batch_norm_eval_rule, weighted_rule
from mixedad._function_hook import direct, original_apply
from mixedad._local_rule import NeedsWholeG, local_jvp
from mixedad._rnn import FUSED_RNNS, rnn_split_rule
from mixedad import _function_probes as probes
from mixedad._grad_mode import GRAD_MODE_SETTERS, no_graph, run_as_constant
from mixedad._threads import unwatched
from mixedad._transforms import in_functorch_transform, under_vmap
from mixedad._trees import tree_flatten

FROZEN, ATTENTION, FORMULA, LOCAL, FORWARD, WHOLE_G = (
    "frozen layer", "blockwise attention", "written formula", "local double-VJP", "forward AD", "whole-G fallback")
#: Every path, in the order the report lists them.
PATHS = (FROZEN, ATTENTION, FORMULA, LOCAL, FORWARD, WHOLE_G)
#: The paths a pass can be told not to take (:func:`skipping`, ``OpRules(skip=...)``).
SKIPPABLE = (FROZEN, ATTENTION, FORMULA, LOCAL)

#: Torch ops whose forward-AD formula in PyTorch is known to be silently wrong: they take the
#: local rule although forward AD "works". name: (upstream issue, what goes wrong). The umbrella
#: issue is pytorch#198017. Checked and found consistent, so not listed: ``hardsigmoid``, whose
#: float64 derivative is float32(1/6) (3e-8 off) in forward and reverse mode alike; mixedad
#: follows reverse mode, which is the meaning.
KNOWN_WRONG = {
    "cholesky_inverse": ("pytorch#196682", "wrong tangent for a non-diagonal factor (relative error 0.45)"),
    "cholesky_solve": ("pytorch#196694", "wrong tangent for a batched factor with a broadcast right-hand side "
                                         "(relative error 113)"),
    "logcumsumexp": ("pytorch#196705", "wrong tangent for logits far apart (0.48 where 1.0 is right)"),
}

#: Torch ops whose forward-AD formula silently drops the tangent (the output comes back without
#: one although it depends on the input): ``scatter_reduce`` with ``reduce="prod"``.
DROPS_TANGENT = ("scatter_reduce",)

#: Torch ops with no forward-AD formula in PyTorch (torch 2.13), sent straight to the local rule
#: instead of being found by a failed first attempt. ``torch.cdist`` has a written formula.
NO_FORMULA = ("cholesky", "ormqr", "index_reduce", "grid_sampler", "grid_sampler_2d", "grid_sampler_3d")


class Rule(NamedTuple):
    """One path for one op: ``apply(call, func, args, kwargs)`` returns the result or NotImplemented.

    With ``reenters``, ``apply`` also takes keyword ``dispatch``: ``dispatch(func, *args)`` runs a
    torch call through the dispatch again, so that call takes its own path (:mod:`mixedad._rnn`).
    """

    path: str
    apply: Callable
    reason: str
    reenters: bool = False


#: Torch functions that need G's reverse graph: G differentiates inside itself, or changes its
#: own gradients with a hook (which forward mode never runs). All of G then takes the whole-G
#: fallback; for hooks at double backward's own cotangent, since a hook need not be linear.
REVERSE_MODE_INSIDE = {
    torch.autograd.grad: "G calls torch.autograd.grad inside itself",
    torch.autograd.backward: "G calls torch.autograd.backward inside itself",
    torch.Tensor.backward: "G calls Tensor.backward inside itself",
    torch.Tensor.register_hook: "G registers a gradient hook (Tensor.register_hook), which forward mode never runs",
}
GRADIENT_HOOKS = (torch.Tensor.register_hook,)
#: ``t.requires_grad`` as G reads it: True for a tensor that carries a tangent, as in reverse mode
#: (G may branch on it: ``if h.requires_grad: h.register_hook(...)``).
REQUIRES_GRAD = torch.Tensor.requires_grad.__get__
#: Reverse-mode graph attributes as G reads them: forward mode has no graph, so a G that branches
#: on them takes the whole-G fallback, where they are what double backward sees.
GRAPH_ATTRIBUTES = {torch.Tensor.is_leaf.__get__: "Tensor.is_leaf", torch.Tensor.grad_fn.__get__: "Tensor.grad_fn"}
_WARNED_JVP = weakref.WeakSet()


#: Ops of other namespaces than aten (``torch.library.custom_op``, torchvision's C++ ops): PyTorch
#: has no forward-AD rule for them and may drop their tangent silently, so they take the local rule,
#: which differentiates the backward they registered.
LIBRARY_OP_RULE = Rule(LOCAL, lambda *a: _local(*a), "library op: no forward-AD rule")


def _library_op(func):
    if isinstance(func, torch._ops.OpOverload):
        namespace = func.namespace
    elif isinstance(func, torch._ops.OpOverloadPacket):  # its .namespace would look for an overload
        namespace = func._qualified_op_name.split("::")[0]
    else:
        return False
    return namespace not in ("aten", "prim", "prims")


def _warn_jvp_disagrees(call, cls, numbers):
    lhs, rhs = numbers
    warnings.warn(
        f"{call}: {cls.__qualname__}.jvp disagrees with its backward: the dot-product test on random "
        f"t, u gives <jvp(t), u> = {lhs:.6g} but <t, backward(u)> = {rhs:.6g}. Reverse mode is the "
        f"meaning, so mixedad differentiates its backward instead (the local double-VJP rule). "
        f"Fix the jvp, or remove it.", RuntimeWarning, stacklevel=2)


class UnderTransformError(OpRuleError):
    """Something in G that mixedad cannot do inside a torch.func transform (vmap over mixed_grad,
    mixed_jacobian's batched pass); ``mixed_jacobian`` then pushes one tangent per pass."""


class RestartPass(Exception):
    """An op's forward-AD formula raised; the pass restarts with that op on the local rule."""

    def __init__(self, op, error):
        super().__init__(f"{op}: {error}")
        self.op, self.error = op, error


@functools.lru_cache(maxsize=None)
def op_name(func):
    """A readable name for a torch function: ``torch.nn.functional.linear``, ``torch.Tensor.add``."""
    return resolve_name(func) or getattr(func, "__qualname__", None) or repr(func)


def _local(call, func, args, kwargs):
    with direct():  # the op's own reverse passes see the Functions it runs as torch defines them
        return local_jvp(call, op_name(func), func, args, kwargs)


def _torch_funcs(name):
    """The torch functions called ``name``: ``torch.name``, ``Tensor.name`` and ``Tensor.name_``."""
    found = [getattr(torch, name, None), getattr(torch.Tensor, name, None), getattr(torch.Tensor, name + "_", None)]
    return [f for f in found if f is not None]


def _build_table():
    table = {func: Rule(FROZEN, weighted_rule, "frozen weights") for func in WEIGHTED}
    table[F.batch_norm] = Rule(FROZEN, batch_norm_eval_rule, "eval-mode statistics")
    table[F.scaled_dot_product_attention] = Rule(ATTENTION, sdpa_rule, "fused primal, blockwise tangent")
    table[torch.cdist] = Rule(FORMULA, cdist_rule, "no forward-AD formula; its backward is not differentiable")
    table[F.group_norm] = Rule(FORMULA, group_norm_rule, "PyTorch's formula raises on non-contiguous input")
    for func in FUSED_RNNS:
        table[func] = Rule(FORMULA, rnn_split_rule, "multi-layer RNN split per layer", reenters=True)
    for name, (issue, what) in KNOWN_WRONG.items():
        for func in _torch_funcs(name):
            table[func] = Rule(LOCAL, _local, f"known-wrong formula ({issue})")
    for name in NO_FORMULA:
        for func in _torch_funcs(name):
            table[func] = Rule(LOCAL, _local, "no forward-AD formula")
    for name in DROPS_TANGENT:
        for func in _torch_funcs(name):
            table[func] = Rule(LOCAL, _local, "PyTorch's formula drops the tangent")
    table[F.grid_sample] = Rule(LOCAL, _local, "no forward-AD formula")
    return table


#: The one table: torch function -> Rule. Ops not in it take plain forward AD.
TABLE = _build_table()

# Ops whose formula raised at run time: func -> {key: reason}, the key an input signature, or for
# an op without a formula the dtypes and devices of its floating-point inputs. Shared by every
# pass in the process, so each op and key costs one restarted pass at most.
_FAILED = {}
_FAILED_LOCK = threading.Lock()
_MAX_FAILED_SIGNATURES = 256


def _signature(args, kwargs):
    leaves, spec = tree_flatten((args, kwargs))
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append((leaf.dtype, leaf.device.type, tuple(leaf.shape), tuple(leaf.stride()) if leaf.layout == torch.strided else None))
        else:
            try:
                hash(leaf)
                parts.append(leaf)
            except TypeError:
                parts.append(type(leaf).__name__)
    return (str(spec), tuple(parts))


def _kinds(args, kwargs):
    """The key of a "no formula" failure: the (dtype, device type) pairs of the op's floating inputs.

    PyTorch picks an op's kernel, and with it whether there is a formula, by dtype and device (a
    float32 LSTM on the CPU runs oneDNN's kernel, which has none; a float64 one does not).
    """
    kinds = {(leaf.dtype, leaf.device.type) for leaf in tree_flatten((args, kwargs))[0]
             if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())}
    return ("no formula", tuple(sorted(kinds, key=str)))


def _remember_failure(func, args, kwargs, error):
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if len(reason) > 120:
        reason = reason[:117] + "..."
    # "no formula" holds for every input of the same dtypes and devices; other failures (a size
    # error, a layout) may not.
    signature = _kinds(args, kwargs) if "does not support it" in reason else _signature(args, kwargs)
    with _FAILED_LOCK:
        seen = _FAILED.setdefault(func, {})
        if len(seen) < _MAX_FAILED_SIGNATURES:
            seen[signature] = f"forward-AD formula raised: {reason}"


def _failed_rule(func, args, kwargs):
    seen = _FAILED[func]
    reason = seen.get(_kinds(args, kwargs)) or seen.get(_signature(args, kwargs))
    return None if reason is None else Rule(LOCAL, _local, reason)


def forget_failures():
    """Clear the process-wide memory of ops whose forward-AD formula raised (for tests)."""
    with _FAILED_LOCK:
        _FAILED.clear()


_settings = threading.local()


@contextlib.contextmanager
def skipping(*paths):
    """Passes started in this thread inside the block do not take ``paths`` (benchmarks use it).

    ``skipping(LOCAL, FORMULA)`` gives mixedad as it was before per-op rules: an op forward mode
    cannot take sends all of G to the whole-G fallback.
    """
    unknown = [p for p in paths if p not in SKIPPABLE]
    if unknown:
        raise ValueError(f"skipping(*paths): expected paths from {list(SKIPPABLE)}, got {unknown}.")
    previous = getattr(_settings, "skip", ())
    _settings.skip = tuple(previous) + paths
    try:
        yield
    finally:
        _settings.skip = previous


def _has_own_jvp(cls):
    return cls.jvp is not Function.jvp


def _run_checkpoint_directly(args):
    run_function, _preserve_rng_state, *inputs = args
    return run_function(*inputs)


class OpRules(TorchFunctionMode):
    """The dispatch: inside mixedad's forward-AD pass, sends each op to its path.

    Args:
        call: the public call's name, for messages.
        recorder: None, or a :class:`PathRecorder` that counts which op took which path.
        skip: keyword-only; paths not to take (``FROZEN``, ``ATTENTION``, ``FORMULA``, ``LOCAL``), for
            benchmarks and the zoo's calibration. Ops then take PyTorch's formula, and without
            ``LOCAL`` a formula that raises is not retried (the whole-G fallback takes G).
    """

    def __init__(self, call, recorder=None, *, skip=None):
        super().__init__()
        self.call, self.recorder = call, recorder
        skip = getattr(_settings, "skip", ()) if skip is None else skip
        self.local = LOCAL not in skip
        self.attention = ATTENTION not in skip
        self.table = {f: r for f, r in TABLE.items() if r.path not in skip} if skip else TABLE
        self.failed = _FAILED if self.local else {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if in_functorch_transform():
            return func(*args, **kwargs)  # G runs torch.func.vmap (or another transform) inside
        if func in GRAD_MODE_SETTERS:
            return func(*args, **kwargs)
        if not torch.is_grad_enabled():  # G turned grad off here: a constant, as in reverse mode
            return run_as_constant(func, args, kwargs)
        if func in COMPOSITES:
            return run_inside(self, func, args, kwargs)
        if func in REVERSE_MODE_INSIDE:
            raise NeedsWholeG(REVERSE_MODE_INSIDE[func], at_cotangent=func in GRADIENT_HOOKS)
        if func == REQUIRES_GRAD and any_tangent(args):
            return True  # as in reverse mode, where what depends on z requires grad
        if func in GRAPH_ATTRIBUTES and any_tangent(args):
            raise NeedsWholeG(f"G reads {GRAPH_ATTRIBUTES[func]} of a tensor that depends on z, which only a "
                              f"reverse pass has")
        with no_graph():  # tangents only: no reverse graph through G's parameters
            return self._dispatch(func, args, kwargs)

    def _dispatch(self, func, args, kwargs):
        rule = self.table.get(func) or (LIBRARY_OP_RULE if self.local and _library_op(func) else None)
        if rule is not None:
            result = self._apply(rule, func, args, kwargs)
            if result is not NotImplemented:
                return result
        if func in self.failed:  # its formula raised before, for these inputs: the local rule
            rule = _failed_rule(func, args, kwargs)
            if rule is not None:
                result = self._apply(rule, func, args, kwargs)
                if result is not NotImplemented:
                    return result
        try:
            result = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as error:
            if isinstance(error, OpRuleError) or not self.local or not any_tangent((args, kwargs)):
                raise
            _remember_failure(func, args, kwargs, error)
            raise RestartPass(op_name(func), error) from error
        if self.recorder is not None and any_tangent(result):
            self.recorder.add(op_name(func), FORWARD, "PyTorch's formula")
        return result

    def _apply(self, rule, func, args, kwargs):
        if rule.reenters:
            result = rule.apply(self.call, func, args, kwargs, dispatch=self._reenter)
        else:
            result = rule.apply(self.call, func, args, kwargs)
        if isinstance(result, Rerouted):
            if self.recorder is not None:
                self.recorder.add(op_name(func), result.path, result.reason)
            return result.value
        if result is not NotImplemented and self.recorder is not None:
            self.recorder.add(op_name(func), rule.path, rule.reason)
        return result

    def _reenter(self, func, *args, **kwargs):
        """``func(*args, **kwargs)`` through this dispatch, from inside a rule (grad on, as at the rule's op)."""
        with torch.enable_grad(), self:
            return func(*args, **kwargs)

    def _popped(self):
        return popped(self)

    def custom_function(self, cls, args, kwargs):
        """The dispatch for ``cls.apply(*args, **kwargs)``, a custom autograd.Function.

        A Function called with grad disabled is a constant. Otherwise the first call of each
        class probes its backward (:mod:`mixedad._function_probes`): one that is not linear in
        its incoming gradient sends all of G to the whole-G fallback at double backward's own
        cotangent; a ``jvp`` that fails the dot-product test against the backward is not
        trusted (a warning, then the local rule); a Function without ``jvp`` takes the local rule.
        """
        if cls is CheckpointFunction:
            return self._custom_function(cls, args, kwargs)
        with unwatched():  # threads a Function starts inside its forward are its own business
            return self._custom_function(cls, args, kwargs)

    def _custom_function(self, cls, args, kwargs):
        name = f"{cls.__qualname__} (custom Function)"
        apply = functools.partial(original_apply, cls)
        if cls is CheckpointFunction:
            if self.recorder is not None:
                self.recorder.add("torch.utils.checkpoint (reentrant)", FORWARD, "run directly: no recomputation needed")
            return _run_checkpoint_directly(args)
        if not torch.is_grad_enabled():  # G turned grad off here: a constant, as in reverse mode
            return run_as_constant(apply, args, kwargs)
        if not any_tangent((args, kwargs)):
            with no_graph():
                return apply(*args, **kwargs)
        own_jvp = _has_own_jvp(cls)
        with self._popped(), direct():  # the probes run the op plainly, as __torch_function__ runs ops
            found = probes.verdict(cls, apply, args, kwargs, with_jvp=own_jvp)
        if not found.linear:
            raise NeedsWholeG(f"{name} has a backward that is not linear in its incoming gradient (gradient "
                              f"clipping or normalisation?), and only double backward's own cotangent gives "
                              f"its derivative", at_cotangent=True)
        if own_jvp and not found.jvp_agrees and cls not in _WARNED_JVP:
            _WARNED_JVP.add(cls)
            _warn_jvp_disagrees(self.call, cls, found.numbers)
        if self.local and (not own_jvp or not found.jvp_agrees):
            with self._popped(), no_graph(), direct():  # the op runs plainly, as inside __torch_function__
                result = local_jvp(self.call, name, apply, args, kwargs, custom=True)
            if self.recorder is not None:
                self.recorder.add(name, LOCAL, "custom Function without jvp" if not own_jvp
                                  else "its jvp disagrees with its backward")
            return result
        with no_graph():
            result = apply(*args, **kwargs)
        if self.recorder is not None and any_tangent(result):
            self.recorder.add(name, FORWARD, "its own jvp")
        return result


class CheckpointsRunDirectly:
    """``Function.apply`` handler for reverse passes: reentrant checkpoints run directly.

    A reentrant checkpoint refuses ``torch.autograd.grad``; run directly, the block records an
    ordinary graph (the reverse passes keep G's graph anyway). Other Functions are untouched.
    """

    def custom_function(self, cls, args, kwargs):
        if cls is CheckpointFunction:
            return _run_checkpoint_directly(args)
        return original_apply(cls, *args, **kwargs)


class FunctionsUnderTransforms:
    """``Function.apply`` handler for passes under torch.func transforms (vmap over mixed_grad).

    torch.func runs a custom Function only if it defines ``setup_context``, and pushes a tangent
    through it only with its own ``jvp``; the op rules step aside there. A Function that lacks
    either gets a mixedad error that names it and says what to do, instead of torch.func's.
    """

    under_transforms = True

    def __init__(self, call):
        self.call = call

    def custom_function(self, cls, args, kwargs):
        needs = [("setup_context", _has_setup_context(cls)), ("jvp", _has_own_jvp(cls))]
        if under_vmap():
            needs.append(("vmap (or generate_vmap_rule = True)", cls.generate_vmap_rule or _has_own_vmap(cls)))
        missing = [what for what, ok in needs if not ok]
        if missing and cls is not CheckpointFunction:
            raise FunctionUnderTransformError(
                f"{self.call}: G calls the custom autograd.Function {cls.__qualname__} inside a torch.func "
                f"transform (vmap over mixed_grad, or a batched pass), and torch.func can only push "
                f"tangents through a Function that defines {' and '.join(missing)}. Give it "
                f"{' and '.join(missing)}, or call mixed_grad once per tangent (mixed_jacobian does "
                f"that by itself), where mixedad's per-op rules take it."
            )
        return original_apply(cls, *args, **kwargs)


class FunctionUnderTransformError(UnderTransformError):
    """A custom Function that torch.func cannot run inside mixedad's batched pass."""


def _has_own_vmap(cls):
    return getattr(cls, "vmap", None) is not Function.vmap


def _has_setup_context(cls):
    return getattr(cls, "setup_context", None) is not _SingleLevelFunction.setup_context


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
                found = probes.verdict(cls, functools.partial(original_apply, cls), args, kwargs, with_jvp=False)
            self.at_cotangent = self.at_cotangent or not found.linear
        return super().custom_function(cls, args, kwargs)


def _requires_grad(tree):
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(tree)[0])


@contextlib.contextmanager
def popped(mode):
    """``mode`` off for the block, when it is the innermost torch function mode."""
    depth = torch._C._len_torch_function_stack()
    if depth and torch._C._get_function_stack_at(depth - 1) is mode:
        with _pop_mode_temporarily():
            yield
    else:
        yield


class PathRecorder:
    """Counts, per op, the calls that took each path; and the whole-G fallback, if any."""

    def __init__(self):
        self.counts = {}
        self.fallback = None

    def add(self, op, path, reason):
        key = (op, path, reason)
        self.counts[key] = self.counts.get(key, 0) + 1
