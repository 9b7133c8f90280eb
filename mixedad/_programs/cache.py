"""Running tangent programs: the default's, eagerly, and ``compile=True``'s, compiled; both checked.

Per G and per key (:mod:`mixedad._programs.key`), the first call that takes a program

1. writes G's tangent program (:mod:`mixedad._programs.program`); where G has no program, the
   call runs mixedad's per-op pass (with ``compile=True``, with a warning that names what has no rule);
2. with ``compile=True``, compiles it with ``torch.compile`` (a batch of tangents: ``torch.vmap`` of
   the program over its tangents, compiled), says so on standard error, and times it;
3. runs mixedad's per-op pass, then the program from the same random state and buffers, and
   compares every output and every tangent (G's state then ends as the per-op pass left it). A
   compiler that drops or changes a tangent (PyTorch's inductor has: pytorch#187284, #192985), or
   a program of mixedad's that differs, fails this check: the key takes the per-op pass from then
   on, with a warning. The call returns the per-op pass's numbers. The default's check (no compiler)
   runs the program first and keeps only a sketch of its outputs (:mod:`mixedad._programs.sketch`),
   so that one pass's outputs are alive at a time and the call's peak is that of the per-op pass.

Later calls with the key run the program alone. A compile or run that raises falls back to the
per-op pass with a warning too. :func:`push_compiled` takes a program from a key's first call;
:func:`push_program`, the default, from the second call with the same inputs' layouts (a G called
once writes nothing). :func:`compiled_tangents` lists what was compiled, with compile times.
"""
import dataclasses
import sys
import threading
import time
import weakref
from typing import Any, ContextManager, Dict, List, Optional

import torch
from torch import nn

from mixedad._entry import warn_once
from mixedad._ground import random_state
from mixedad._ground.watch import off as watch_off
from mixedad._ground.state import Snapshot
from mixedad._ground.forward_pass import FORWARD_PASS_LOCK
from mixedad._hooks.functorch import in_functorch_transform
from mixedad._hooks.dispatch_modes import only_observers_active
from mixedad._hooks.meta_trace import modes_active
from mixedad._hooks.thread_local import setting
from mixedad.op_rules import PathRecorder
from mixedad.op_rules._user import generation
from mixedad._programs.key import key_of
from mixedad._programs import sketch
from mixedad._programs.program import write
from mixedad._programs.rules import Unsupported

__all__ = ["CompiledTangent", "compiled_tangents", "per_op_pass", "push_compiled", "push_program", "TOLERANCE"]

#: Largest difference between the compiled and the eager tangent (and output), in the 2-norm
#: relative to the eager one's, that the check accepts, by dtype. Compilers reorder sums, and
#: where a ReLU's input lies within round-off of zero the two take different sides of the kink.
#: Some tangents are ill-conditioned in float32: through train-mode batch norm (the DCGAN of the
#: speed benchmark) the eager pass itself is 4e-3 from float64 in this norm, and the compiled
#: program 4.5e-3, 2.5e-3 apart. A dropped tangent differs by 1, a dropped term by its share.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 2e-2}
_REDUCED = 1e-1
#: The same for the default's programs, which run the per-op pass's kernels without a compiler, with G's own calls
#: for the primal (so every ReLU kink falls as in the per-op pass): only the order of a few operations in the
#: tangent differs (the batch-norm scale in the convolution's weight, as the per-op rule folds it), so the bound is
#: round-off, and tight on purpose, so that a tangent 0.5% off fails. In bfloat16 and float16 round-off is large:
#: on the zoo's DCGAN the per-op pass itself lies 7% to 8% (bfloat16) and 3% (float16) from float64.
EAGER_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-3}
_EAGER_REDUCED = 1e-1
#: Outputs and tangents whose root mean square lies below this many epsilons of the inputs' are
#: round-off (zero in exact arithmetic), compared by that bound and not relative to themselves;
#: never above :data:`ROUND_OFF_CAP` of the inputs' (a thousand epsilons of bfloat16 are 8 times the
#: inputs' size, under which a dropped tangent would pass for round-off).
ROUND_OFF = 1000
ROUND_OFF_CAP = 1e-2


@dataclasses.dataclass
class CompiledTangent:
    r"""One compiled tangent program of a G: for which inputs, whether it is used, and what it cost.

    A program is used once its first call passed the check against mixedad's eager pass,
    output by output of G (primal :math:`g` and tangent :math:`\dot g`):

    .. math::

        \lVert \dot g_{\text{compiled}} - \dot g_{\text{eager}} \rVert_2
            \le \tau \, \lVert \dot g_{\text{eager}} \rVert_2

    with :math:`\tau` from :data:`TOLERANCE` by dtype (:math:`2 \cdot 10^{-2}` in float32).

    Attributes:
        inputs: ``(shape, dtype)`` of each input of G.
        tangents: 1 for mixed_grad and input_grad, k for a batch of k (mixed_jacobian).
        status: "compiled" (compiled, checked against the per-op pass, and in use), "program" (the default's
            program, run without a compiler: checked and in use) or "eager" (the key runs mixedad's per-op pass:
            see ``reason``).
        reason: why this key runs the per-op pass; empty otherwise.
        compile_seconds: time of the first compiled call (compiling included), or None.
        difference: the check's largest relative difference from the eager pass, or None.

    Example:
        >>> import torch, mixedad
        >>> entry = mixedad.programs.CompiledTangent(inputs=[((4, 8), torch.float32)], tangents=1)
        >>> entry.status, entry.compile_seconds
        ('eager', None)
    """

    inputs: List[Any]
    tangents: int
    status: str = "eager"
    reason: str = ""
    compile_seconds: Optional[float] = None
    difference: Optional[float] = None
    program: Any = dataclasses.field(default=None, repr=False)
    spec: Any = dataclasses.field(default=None, repr=False)
    held: Any = dataclasses.field(default=None, repr=False)
    run: Any = dataclasses.field(default=None, repr=False)
    compiled: bool = dataclasses.field(default=True, repr=False)


_LOCK = threading.Lock()
#: The most programs kept per G (one per key); beyond, the least recently used is dropped.
MAX_PROGRAMS = 8
_CACHE: "weakref.WeakKeyDictionary[nn.Module, Dict[Any, CompiledTangent]]" = weakref.WeakKeyDictionary()
#: The default's programs (run without the compiler), per G and key, as ``_CACHE``.
_EAGER: "weakref.WeakKeyDictionary[nn.Module, Dict[Any, CompiledTangent]]" = weakref.WeakKeyDictionary()
#: Per G and inputs' layouts (and its modules' train/eval modes): "again" once the default saw them, "never" where
#: G has no program for them; at most :data:`MAX_SEEN` per G, the least recently seen dropped.
MAX_SEEN = 64
_SEEN: "weakref.WeakKeyDictionary[nn.Module, Dict[Any, str]]" = weakref.WeakKeyDictionary()


def compiled_tangents(G: nn.Module) -> List[CompiledTangent]:
    r"""The tangent programs ``compile=True`` keeps for G, one per key, least recently used first (at most
    :data:`MAX_PROGRAMS`).

    A key is one set of input shapes, strides, dtypes and devices, one number of tangents, and
    one state of G's modules (which modules, in which train/eval mode). Each entry says whether
    its program runs compiled, and its compile time (the first call: compiling, running, and the
    check against the eager pass,

    .. math::

        t_{\text{first}} = t_{\text{compile}} + t_{\text{compiled run}} + t_{\text{eager pass}}).

    Example:
        >>> import torch, mixedad
        >>> G = torch.nn.Linear(3, 2)
        >>> mixedad.programs.compiled_tangents(G)
        []
    """
    return list(_CACHE.get(G, {}).values())


def _refusal(G, zs, vs, observers=False):
    """Why this call cannot take a program at all (before any key), or None. With ``observers``, dispatch modes
    that only watch (``mixedad.profiling``'s byte counters: a class attribute ``observes_only``) are no reason."""
    if not isinstance(G, nn.Module):
        return f"G is a {type(G).__name__}, and tangent programs take an nn.Module"
    if in_functorch_transform():
        return "the call runs inside a torch.func transform"
    if modes_active() and not (observers and only_observers_active()):
        return "a torch function or dispatch mode is active"
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        return "autocast is on"
    if any(type(t) is not torch.Tensor or t.layout != torch.strided for t in (*zs, *vs)):
        return "an input is a tensor subclass or not strided"
    if any(t.device.type == "meta" for t in (*zs, *vs)):
        return "an input is on the meta device (a memory plan)"
    return None


def _flag(name):
    return setting(_SWITCHES, name, True)


def programs_unchecked():
    """For tests of the programs themselves: in this thread, the default's first call with new inputs' layouts
    writes G's program and runs it alone, with no per-op pass to check it against."""
    return _flag("unchecked")


def per_op_pass() -> ContextManager[None]:
    r"""Inside the block, in this thread, ``mixed_grad`` and ``input_grad`` take mixedad's per-op pass on every
    call: the default's tangent programs are neither written nor run (``compile=True`` still compiles).

    Both routes compute the same tangent, op after op of G, and differ by round-off only:

    .. math::

        \dot g = J_{\mathrm{op}_n} \cdots J_{\mathrm{op}_2} J_{\mathrm{op}_1} v

    For comparing the two routes, for benchmarks of the per-op pass, and for a G whose program you want
    to rule out while debugging. Programs already written stay cached for later calls outside the block.

    Example:
        >>> import torch, mixedad
        >>> G = mixedad.zoo.mlp(2, 4)
        >>> z, y, v = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
        >>> f = lambda y, g: (y * g).sum()
        >>> with mixedad.programs.per_op_pass():
        ...     for _ in range(3):
        ...         _ = mixedad.mixed_grad(f, G, z, y, v)
        >>> mixedad.programs.compiled_tangents(G)  # nothing compiled, and no program written
        []
    """
    return _flag("per_op")


_SWITCHES = threading.local()


def _rms(t):
    return t.detach().double().norm().item() / max(t.numel(), 1) ** 0.5


def _differs(compiled, eager, inputs):
    """The largest relative difference (2-norm) over matching leaves, or inf where they do not match.

    A tangent that is None (an output that is no floating-point tensor) matches None or zeros.
    Leaves whose root mean square both lie below the round-off of the ``inputs``' (:data:`ROUND_OFF`
    epsilons times the inputs' root mean square: a tangent that is zero in exact arithmetic, as the
    tangent of ones through a batch norm over the batch) match, the ``eager`` one by that floor capped at
    :data:`ROUND_OFF_CAP` (in bfloat16 the uncapped floor is 8 times the inputs' size: a compiled program
    that dropped a tangent would pass; one whose round-off of a zero is larger than the eager pass's does).
    """
    worst = 0.0
    floor = max((_rms(t) for t in inputs), default=0.0)
    for a, b in zip(compiled, eager, strict=True):
        if a is None or b is None:
            other = b if a is None else a
            if other is not None and (not isinstance(other, torch.Tensor) or other.any()):
                return float("inf")
            continue
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if type(a) is not type(b) or a != b:
                return float("inf")
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return float("inf")
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return float("inf")
            continue
        if not b.numel():
            continue
        loose = ROUND_OFF * torch.finfo(b.dtype).eps * floor
        if _rms(b) <= min(loose, ROUND_OFF_CAP * floor) and _rms(a) <= loose:
            continue  # both are round-off (the eager one by the capped floor: a dropped tangent is never round-off)
        a64, b64 = a.detach().double(), b.detach().double()
        relative = ((a64 - b64).norm() / b64.norm().clamp_min(torch.finfo(torch.float64).tiny)).item()
        if relative != relative:  # NaN
            return float("inf")
        worst = max(worst, relative)
    return worst


def _describe_inputs(zs):
    return ", ".join(f"{tuple(z.shape)} {str(z.dtype).replace('torch.', '')}" for z in zs)


def _program_fn(entry, batch, n):
    """The written program as a function of ``(*zs, *vs)``: for a batch of tangents, its vmap over them."""
    program = entry.program.module
    if batch:
        return torch.vmap(program, in_dims=(None,) * n + (0,) * n, out_dims=(None, 0))
    return program


def _compile(entry, batch, n):
    return torch.compile(_program_fn(entry, batch, n), dynamic=False)


def push_compiled(call, G, zs, vs, eager_push, *, batch=0):
    """``(g_leaves, tangent_leaves, spec)`` of G at zs along vs, by G's compiled tangent program.

    ``eager_push()`` is mixedad's eager pass for the same inputs: the check on a key's first
    call, and the fallback wherever no compiled program runs. ``batch``: 0 for one tangent, k
    for tangents with a leading dimension of k.
    """
    with watch_off():  # a program draws no random numbers (the check refuses G that does)
        return _push_compiled(call, G, zs, vs, eager_push, batch)


def _push_compiled(call, G, zs, vs, eager_push, batch):
    refusal = _refusal(G, zs, vs)
    if refusal is not None:
        warn_once(("compile refused", call, refusal), f"mixedad: {call} with compile=True runs eager here: {refusal}.")
        return eager_push()
    key, held = key_of(G, zs, vs, batch)
    entry, first = _entry(_CACHE, G, key, held, zs, batch, evicted=lambda: warn_once(
        ("compile evicts", id(G)),
        f"mixedad: {call} with compile=True has written {MAX_PROGRAMS} programs for {type(G).__name__} (one per "
        f"input shape, dtype and state of G); each new one compiles again, and the least recently used is dropped. "
        f"Keep z's shape fixed (pad the batch) to compile once."))
    if first:
        return _settle(_CACHE, G, zs, vs, batch, key, entry,
                       _first_call(call, G, zs, vs, eager_push, entry, batch, compile=True))
    return _run(call, G, zs, vs, eager_push, entry)


def push_program(call, G, zs, vs, eager_push):
    """``(g_leaves, tangent_leaves, spec)`` of G at zs along vs, by G's tangent program run eagerly, or by
    ``eager_push()`` (mixedad's per-op pass).

    Programs are written here only for an ``nn.Sequential`` chain of ``torch.nn`` layers
    (:func:`mixedad._programs.trace.chain`): no code of the user's is traced, so nothing it reads
    outside the key can go stale. The per-op pass is the default's first call for G and these inputs'
    layouts, and every call of any other G: nothing is written for a G called once. The second call writes the program, runs it
    and the per-op pass from the same state and compares them, one pass's outputs alive at a time; from then
    on the program runs alone, with no per-op dispatch. G's refusals are silent: the per-op pass is
    mixedad's own path, not a fallback. A program that differs from the per-op pass, or raises, is
    dropped with a warning (mixedad's own error, to report).
    """
    if type(G) is not nn.Sequential or getattr(_SWITCHES, "per_op", None):
        return eager_push()  # any other G: no program (see chain), and no key computed
    with watch_off():  # a program draws no random numbers (the check refuses G that does)
        return _push_program(call, G, zs, vs, eager_push)


def _push_program(call, G, zs, vs, eager_push):
    if _refusal(G, zs, vs, observers=True) is not None:
        return eager_push()
    unchecked = bool(getattr(_SWITCHES, "unchecked", None))
    layouts = (tuple((t.shape, t.stride(), t.dtype, t.device) for t in (*zs, *vs)),
               tuple(m.training for m in G.modules()), generation())
    with _LOCK:
        seen = _SEEN.setdefault(G, {})
        status = seen.pop(layouts, None)
        if status is None and len(seen) >= MAX_SEEN:
            del seen[next(iter(seen))]  # the least recently seen layouts
        seen[layouts] = "again" if status is None else status
    if status != "again" and not (unchecked and status is None):  # the first call, or G has no program for them
        return eager_push()
    key, held = key_of(G, zs, vs, 0)
    entry, first = _entry(_EAGER, G, key, held, zs, 0)
    if first:
        result = _first_call(call, G, zs, vs, eager_push, entry, 0, compile=False, check=not unchecked)
        if entry.program is None:  # G has no program: not looked for again with these layouts
            with _LOCK:
                _SEEN.setdefault(G, {})[layouts] = "never"
        return _settle(_EAGER, G, zs, vs, 0, key, entry, result)
    return _run(call, G, zs, vs, eager_push, entry)


def runs_program(G, zs, vs):
    """Whether the default's next call for G at these inputs runs a checked tangent program (not the per-op pass)."""
    if type(G) is not nn.Sequential or getattr(_SWITCHES, "per_op", None):
        return False
    with watch_off():
        if _refusal(G, zs, vs, observers=True) is not None:
            return False
        key, _ = key_of(G, zs, vs, 0)
    with _LOCK:
        entry = _EAGER.get(G, {}).get(key)
    return entry is not None and entry.status != "eager"


def _entry(cache, G, key, held, zs, batch, evicted=None):
    """``(entry, first)``: G's entry for ``key`` in ``cache`` (made, if ``first``), now its most recently used."""
    with _LOCK:  # threads share the cache; a key's first call writes once, the others run eager meanwhile
        entries = cache.setdefault(G, {})
        entry = entries.pop(key, None)
        first = entry is None
        if first:
            if len(entries) >= MAX_PROGRAMS:
                del entries[next(iter(entries))]  # the least recently used program of G, and its compiled code
                if evicted is not None:
                    evicted()
            entry = CompiledTangent([(tuple(z.shape), z.dtype) for z in zs], batch or 1)
            entry.held = held
        entries[key] = entry  # the most recently used last
    return entry, first


def _settle(cache, G, zs, vs, batch, key, entry, result):
    """File ``entry`` under the key as G is after its first call, and return that call's ``result``.

    The first call's snapshots put tensors back in place, which bumps their version counters: the
    next call, with G as it is now, finds the entry."""
    settled, entry.held = key_of(G, zs, vs, batch)
    if settled != key:
        with _LOCK:
            entries = cache.get(G, {})
            if entries.get(key) is entry:
                del entries[key]
                entries[settled] = entry
    return result


def _run(call, G, zs, vs, eager_push, entry):
    """A later call of a key: its program, or the eager pass where it has none."""
    if entry.status == "eager":
        return eager_push()
    try:
        with torch.no_grad():
            primals, tangents = entry.run(*zs, *vs)
    except Exception as error:  # noqa: BLE001 - any failure of a program's run falls back to eager
        _fall_back(call, G, entry, f"the {'compiled ' if entry.compiled else ''}program raised "
                                   f"{type(error).__name__}: {error}")
        return eager_push()
    return list(primals), list(tangents), entry.spec


def _in_use(entry):
    """The status of a program that passed its check: "compiled" where the compiler made it, else "program"."""
    return "compiled" if entry.compiled else "program"


def _fall_back(call, G, entry, reason, warn=True):
    entry.status, entry.reason, entry.run = "eager", reason, None
    if warn:
        what = "with compile=True runs eager" if entry.compiled else "runs its per-op pass"
        warn_once(("program fell back", entry.compiled, id(G), reason),
                  f"mixedad: {call} {what} for {type(G).__name__} at inputs {_describe_inputs_of(entry)}: {reason}.")


def _describe_inputs_of(entry):
    return ", ".join(f"{shape} {str(dtype).replace('torch.', '')}" for shape, dtype in entry.inputs)


def _first_call(call, G, zs, vs, eager_push, entry, batch, compile, check=True):
    """Write the program, and check it: the default's (:func:`_check_one_pass_at_a_time`), or ``compile``'s: run
    eager, then the compiled program from the same state, and compare; G's state ends as eager left it, and the
    eager numbers are returned. Without ``check`` (tests of the program itself), the program alone runs, and its
    numbers are returned."""
    entry.compiled = compile
    try:
        program = write(G, zs, trace_code=compile)
    except Unsupported as error:
        _fall_back(call, G, entry, f"no tangent program ({error})", warn=compile)
        return eager_push()
    entry.program = program
    if not check:
        entry.spec, entry.status, entry.run = program.spec, _in_use(entry), _program_fn(entry, batch, len(zs))
        return _run(call, G, zs, vs, eager_push, entry)
    if not compile:
        return _check_one_pass_at_a_time(call, G, zs, vs, eager_push, entry)
    before = Snapshot(G, call=call)
    g_leaves, tangent_leaves, spec, refusal = _checked_against(entry, eager_push, before.rng)
    if refusal is not None:  # what the eager pass saw that a program cannot do: nothing to check, G keeps that pass
        _fall_back(call, G, entry, refusal)
        return g_leaves, tangent_leaves, spec
    after = Snapshot(G, call=call)  # the random state and buffers one forward leaves
    before.restore()
    print(f"mixedad: compiling the tangent program of {type(G).__name__} for inputs {_describe_inputs(zs)}"
          f"{f' and {batch} tangents' if batch else ''} (once per G, shapes and dtypes) ...", file=sys.stderr,
          flush=True)
    start = time.perf_counter()
    try:
        run = _compile(entry, batch, len(zs))
        with torch.no_grad():
            primals, tangents = run(*zs, *vs)
    except Exception as error:  # noqa: BLE001 - any compiler failure falls back to eager
        _fall_back(call, G, entry, _blame(entry, batch, zs, vs, error, before))
        after.restore()
        return g_leaves, tangent_leaves, spec
    entry.compile_seconds = time.perf_counter() - start
    after.restore()
    difference = max(_differs(list(primals), g_leaves, zs), _differs(list(tangents), tangent_leaves, vs))
    entry.difference = difference
    tolerance = TOLERANCE.get(zs[0].dtype, _REDUCED)
    if not difference <= tolerance:
        own = _own_difference(entry, batch, zs, vs, g_leaves, tangent_leaves, before, after)
        culprit = ("mixedad's tangent program itself differs, run without the compiler (relative difference "
                   f"{own:.3g}); please report it with G's code" if not own <= tolerance else "a compiler bug")
        _fall_back(call, G, entry, f"the compiled tangent program differs from the eager pass (largest relative "
                                   f"difference {difference:.3g}, tolerance {tolerance:g}): {culprit}")
    else:
        entry.status, entry.run = _in_use(entry), run
        print(f"mixedad: compiled in {entry.compile_seconds:.1f} s; matches the eager pass (largest relative "
              f"difference {difference:.1e}).", file=sys.stderr, flush=True)
    return g_leaves, tangent_leaves, spec


def _unprogrammable(seen, drawn):
    """Why G keeps mixedad's per-op pass, from what its eager pass ``seen`` (a PathRecorder) and the random
    sources it ``drawn`` from; None if nothing there refuses a program."""
    if seen.user_rules:
        return (f"G runs the rule registered for {sorted(seen.user_rules)[0]} with mixedad.op_rules.register, which "
                f"tangent programs do not run (mixedad's per-op pass does)")
    if seen.inputs_written:
        return "G writes into its input in place, which a program would do in the caller's own z and v"
    if drawn:
        return (f"G draws random numbers ({', '.join(drawn)}), which a program would draw otherwise, or bake in as "
                f"constants")
    return None


def _checked_against(entry, eager_push, sources):
    """The per-op pass a program is checked against, run: ``(g_leaves, tangent_leaves, spec, refusal)``, where
    ``refusal`` says what it saw that a program cannot do (:func:`_unprogrammable`; the random ``sources`` as they
    were before it), or is None. Its failure is noted on ``entry`` and raised."""
    seen = PathRecorder()
    try:
        with random_state.watching(sources):
            g_leaves, tangent_leaves, entry.spec = eager_push(recorder=seen)
    except Exception as error:
        entry.reason = f"the eager pass it is checked against refused these inputs ({str(error).strip()[:300]})"
        raise
    return g_leaves, tangent_leaves, entry.spec, _unprogrammable(seen, sources.drawn())


def _check_one_pass_at_a_time(call, G, zs, vs, eager_push, entry):
    """The default's check, with one pass's outputs alive at a time, so that its peak is the larger pass's: the
    program runs first and only a sketch of its outputs is kept (:mod:`mixedad._programs.sketch`), then the per-op
    pass runs from the same random state and buffers, is sketched the same way, and its numbers are returned (G's
    state ends as it left it)."""
    before = Snapshot(G, call=call)
    run = _program_fn(entry, 0, len(zs))
    try:
        # G's modules run, which torch.fx patches while another thread traces: wait for it, as the per-op pass does
        with FORWARD_PASS_LOCK, torch.no_grad():
            primals, tangents = run(*zs, *vs)
        program = sketch.sketches(primals), sketch.sketches(tangents)
        del primals, tangents
    except Exception as error:  # noqa: BLE001 - a program that raises is dropped
        _fall_back(call, G, entry, f"mixedad's tangent program fails on these inputs ({_first_line(error)}); please "
                                   f"report it with G's code")
        before.restore()
        return eager_push()
    before.restore()
    sources = before.rng
    del before  # its copies of G's buffers: the per-op pass takes its own
    g_leaves, tangent_leaves, spec, refusal = _checked_against(entry, eager_push, sources)
    if refusal is not None:  # the program's numbers are not used (a chain never writes its input: trace.chain)
        _fall_back(call, G, entry, refusal, warn=False)
        return g_leaves, tangent_leaves, spec
    bounds = dict(round_off=ROUND_OFF, cap=ROUND_OFF_CAP)
    entry.difference = difference = max(
        sketch.differs(program[0], sketch.sketches(g_leaves), sketch.rms_floor(zs), **bounds),
        sketch.differs(program[1], sketch.sketches(tangent_leaves), sketch.rms_floor(vs), **bounds))
    tolerance = EAGER_TOLERANCE.get(zs[0].dtype, _EAGER_REDUCED)
    if not difference <= tolerance:
        _fall_back(call, G, entry, f"the tangent program differs from mixedad's per-op pass (largest relative "
                                   f"difference {difference:.3g}, tolerance {tolerance:g}): mixedad's program is "
                                   f"wrong here; please report it with G's code")
    else:
        entry.status, entry.run = _in_use(entry), run
    return g_leaves, tangent_leaves, spec


def _first_line(error):
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _own_difference(entry, batch, zs, vs, g_leaves, tangent_leaves, before, after):
    """The program run without the compiler, against the eager pass (inf where it raises)."""
    program = _program_fn(entry, batch, len(zs))
    before.restore()
    try:
        with torch.no_grad():
            primals, tangents = program(*zs, *vs)
    except Exception:  # noqa: BLE001
        return float("inf")
    finally:
        after.restore()
    return max(_differs(list(primals), g_leaves, zs), _differs(list(tangents), tangent_leaves, vs))


def _blame(entry, batch, zs, vs, error, before):
    """Why a compiled first run raised: mixedad's program itself (run eagerly), or the compiler."""
    first_line = _first_line(error)
    program = _program_fn(entry, batch, len(zs))
    before.restore()
    try:
        with torch.no_grad():
            program(*zs, *vs)
    except Exception as own:  # noqa: BLE001 - the program fails without the compiler too
        return f"mixedad's tangent program fails on these inputs ({_first_line(own)}); please report it with G's code"
    return f"torch.compile failed ({first_line})"
