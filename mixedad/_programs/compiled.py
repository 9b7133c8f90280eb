"""``compile=True``: G's tangent program under ``torch.compile``, checked against the eager pass.

Per G and per key (the inputs' shapes, strides, dtypes and devices; one tangent or a batch of k;
which modules G holds and their train/eval modes; the CPU's oneDNN switch), the first call

1. writes G's tangent program (:mod:`mixedad._programs.program`); where G has no program, the
   call runs eager, with a warning that names what has no rule;
2. compiles it with ``torch.compile`` (a batch of tangents: ``torch.vmap`` of the program over its
   tangents, compiled), says so on standard error, and times it;
3. runs mixedad's eager pass, then the compiled program from the same random state and buffers,
   and compares every output and every tangent (G's state then ends as the eager pass left it). A compiler that drops or changes a tangent (PyTorch's inductor
   has: pytorch#187284, #192985) fails this check: the key runs eager from then on, with a warning.
   The first call returns the eager pass's numbers.

Later calls with the key run the compiled program alone. A compile or run that raises falls back
to eager with a warning too. :func:`compiled_tangents` lists what was compiled, with compile times.
"""
import dataclasses
import sys
import threading
import time
import types
import weakref
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from mixedad._entry import warn_once
from mixedad._frontend.state import Snapshot
from mixedad._hooks.functorch import in_functorch_transform
from mixedad._hooks.meta_trace import modes_active
from mixedad._programs.program import write
from mixedad._programs.trace import Unsupported

__all__ = ["CompiledTangent", "compiled_tangents", "push_compiled", "TOLERANCE"]

#: Largest difference between the compiled and the eager tangent (and output), in the 2-norm
#: relative to the eager one's, that the check accepts, by dtype. Compilers reorder sums, and
#: where a ReLU's input lies within round-off of zero the two take different sides of the kink.
#: Some tangents are ill-conditioned in float32: through train-mode batch norm (the DCGAN of the
#: speed benchmark) the eager pass itself is 4e-3 from float64 in this norm, and the compiled
#: program 4.5e-3, 2.5e-3 apart. A dropped tangent differs by 1, a dropped term by its share.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 2e-2}
_REDUCED = 1e-1
#: Outputs and tangents whose root mean square lies below this many epsilons of the inputs' are
#: round-off (zero in exact arithmetic), compared by that bound and not relative to themselves.
ROUND_OFF = 1000


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
        status: "compiled" (checked against eager and in use) or "eager" (see ``reason``).
        reason: why this key runs eager; empty when compiled.
        compile_seconds: time of the first compiled call (compiling included), or None.
        difference: the check's largest relative difference from the eager pass, or None.

    Example:
        >>> import torch, mixedad
        >>> entry = mixedad.CompiledTangent(inputs=[((4, 8), torch.float32)], tangents=1)
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


_LOCK = threading.Lock()
#: The most programs kept per G (one per key); beyond, the least recently used is dropped.
MAX_PROGRAMS = 8
_CACHE: "weakref.WeakKeyDictionary[nn.Module, Dict[Any, CompiledTangent]]" = weakref.WeakKeyDictionary()


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
        >>> mixedad.compiled_tangents(G)
        []
    """
    return list(_CACHE.get(G, {}).values())


_SIMPLE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
#: Attributes every nn.Module has, held elsewhere in the key (tensors, submodules) or refused (hooks).
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _fingerprint(value, held, depth=3, live=False):
    """A value as the key sees it: simple values by value, containers and plain objects by their contents
    (``depth`` levels down), tensors, modules and functions by identity. What is keyed by identity goes
    into ``held``, which the cache entry keeps: an object it keys stays alive, so its id is never reused.
    A tensor also by its version counter, unless ``live`` (parameters and buffers, which a program reads
    when it runs): traced code computes with other tensors when it is written, and keeps the result."""
    if isinstance(value, _SIMPLE):
        return value
    if depth and isinstance(value, (tuple, list)):
        return type(value), tuple(_fingerprint(v, held, depth - 1) for v in value)
    if depth and isinstance(value, dict):
        return dict, tuple((k if isinstance(k, _SIMPLE) else _fingerprint(k, held, 0), _fingerprint(v, held, depth - 1))
                           for k, v in value.items())
    if (depth and not isinstance(value, (torch.Tensor, nn.Module, type, types.ModuleType)) and not callable(value)
            and isinstance(getattr(value, "__dict__", None), dict)):
        return type(value), _fingerprint(vars(value), held, depth - 1)  # a config object, a namespace
    held.append(value)
    if isinstance(value, torch.Tensor):
        if live or value.is_inference():
            return id(value), value.dtype, value.device
        return id(value), value.dtype, value.device, value._version
    return id(value), type(value)


def _module_key(m, held, root):
    attributes = m.__dict__
    if m is not root:  # G itself is the cache's weak key: it is not held, and lives while its entries do
        held.append(m)
    tensors = [_fingerprint(t, held, live=True) for t in attributes["_parameters"].values()]
    tensors += [None, *[_fingerprint(t, held, live=True) for t in attributes["_buffers"].values()]]
    return (id(m), m.training, *tensors, None,
            *[(n, _fingerprint(v, held)) for n, v in attributes.items() if n not in _MODULE_INTERNALS])


_GLOBALS: Dict[type, Any] = {}


def _class_key(cls, held):
    """The attributes of a module class and its bases up to ``nn.Module`` (``scale = 2.0`` in the class body),
    and the globals its ``forward`` names (``SCALE`` in ``x * SCALE``)."""
    names = _GLOBALS.get(cls)
    if names is None:
        forward = getattr(cls.forward, "__code__", None)
        glob = getattr(cls.forward, "__globals__", {})
        bases = tuple(c for c in cls.__mro__ if c not in nn.Module.__mro__)
        names = _GLOBALS[cls] = (glob, tuple(n for n in forward.co_names if n in glob) if forward else (), bases)
    glob, used, bases = names
    return (cls, tuple(_fingerprint(glob.get(n), held) for n in used),
            tuple((n, _fingerprint(v, held)) for c in bases for n, v in vars(c).items() if not n.startswith("__")))


def _key(G, zs, vs, batch):
    """``(key, held)``: what a program is written for (the inputs' layouts; G's modules with their modes,
    tensors and attributes; their classes' attributes and the globals their forwards name: a program reads
    such values as they were when it was written), and the objects the key identifies by id."""
    held: List[Any] = []
    tensors = tuple((t.shape, t.stride(), t.dtype, t.device) for t in (*zs, *vs))
    modules = list(G.modules())
    classes = sorted({type(m) for m in modules}, key=id)
    key = (batch, tensors, tuple(_module_key(m, held, G) for m in modules),
           tuple(_class_key(c, held) for c in classes), torch.backends.mkldnn.enabled)
    return key, held


def _refusal(G, zs, vs):
    """Why this call cannot take a compiled program at all (before any key), or None."""
    if not isinstance(G, nn.Module):
        return f"G is a {type(G).__name__}, and tangent programs take an nn.Module"
    if in_functorch_transform():
        return "the call runs inside a torch.func transform"
    if modes_active():
        return "a torch function or dispatch mode is active"
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        return "autocast is on"
    if any(type(t) is not torch.Tensor or t.layout != torch.strided for t in (*zs, *vs)):
        return "an input is a tensor subclass or not strided"
    return None


def _rms(t):
    return t.detach().double().norm().item() / max(t.numel(), 1) ** 0.5


def _differs(compiled, eager, inputs):
    """The largest relative difference (2-norm) over matching leaves, or inf where they do not match.

    A tangent that is None (an output that is no floating-point tensor) matches None or zeros.
    Leaves whose root mean square both lie below the round-off of the ``inputs``' (:data:`ROUND_OFF`
    epsilons times the inputs' root mean square: a tangent that is zero in exact arithmetic, as the
    tangent of ones through a batch norm over the batch) match.
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
        if max(_rms(a), _rms(b)) <= ROUND_OFF * torch.finfo(b.dtype).eps * floor:
            continue  # both are round-off
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
    refusal = _refusal(G, zs, vs)
    if refusal is not None:
        warn_once(("compile refused", call, refusal), f"mixedad: {call} with compile=True runs eager here: {refusal}.")
        return eager_push()
    key, held = _key(G, zs, vs, batch)
    with _LOCK:  # threads share the cache; a key's first call compiles once, the others run eager meanwhile
        entries = _CACHE.setdefault(G, {})
        entry = entries.pop(key, None)
        first = entry is None
        if first:
            if len(entries) >= MAX_PROGRAMS:
                del entries[next(iter(entries))]  # the least recently used program of G, and its compiled code
                warn_once(("compile evicts", id(G)),
                          f"mixedad: {call} with compile=True has written {MAX_PROGRAMS} programs for "
                          f"{type(G).__name__} (one per input shape, dtype and state of G); each new one compiles "
                          f"again, and the least recently used is dropped. Keep z's shape fixed (pad the batch) "
                          f"to compile once.")
            entry = CompiledTangent([(tuple(z.shape), z.dtype) for z in zs], batch or 1)
            entry.held = held
        entries[key] = entry  # the most recently used last
    if first:
        result = _first_call(call, G, zs, vs, eager_push, entry, batch)
        # The first call's snapshots put tensors back in place, which bumps their version counters: the entry
        # is filed under the key as G now is, so that the next call finds it.
        settled, entry.held = _key(G, zs, vs, batch)
        if settled != key:
            with _LOCK:
                if entries.get(key) is entry:
                    del entries[key]
                    entries[settled] = entry
        return result
    if entry.status != "compiled":
        return eager_push()
    try:
        with torch.no_grad():
            primals, tangents = entry.run(*zs, *vs)
    except Exception as error:  # noqa: BLE001 - any failure of a compiled run falls back to eager
        _fall_back(call, G, entry, f"the compiled program raised {type(error).__name__}: {error}")
        return eager_push()
    return list(primals), list(tangents), entry.spec


def _fall_back(call, G, entry, reason):
    entry.status, entry.reason, entry.run = "eager", reason, None
    warn_once(("compile fell back", id(G), reason),
              f"mixedad: {call} with compile=True runs eager for {type(G).__name__} at inputs "
              f"{_describe_inputs_of(entry)}: {reason}.")


def _describe_inputs_of(entry):
    return ", ".join(f"{shape} {str(dtype).replace('torch.', '')}" for shape, dtype in entry.inputs)


def _first_call(call, G, zs, vs, eager_push, entry, batch):
    """Write, run eager, compile and run compiled from the same state, compare; G's state ends as eager left it."""
    try:
        entry.program = write(G, zs)
    except Unsupported as error:
        _fall_back(call, G, entry, f"no tangent program ({error})")
        return eager_push()
    before = Snapshot(G, call=call)
    try:
        g_leaves, tangent_leaves, spec = eager_push()
    except Exception as error:
        entry.reason = f"the eager pass it is checked against refused these inputs ({str(error).strip()[:300]})"
        raise
    entry.spec = spec
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
        _fall_back(call, G, entry, f"the compiled tangent differs from the eager pass (largest relative "
                                   f"difference {difference:.3g}, tolerance {tolerance:g}): {culprit}")
    else:
        entry.status, entry.run = "compiled", run
        print(f"mixedad: compiled in {entry.compile_seconds:.1f} s; matches the eager pass (largest relative "
              f"difference {difference:.1e}).", file=sys.stderr, flush=True)
    return g_leaves, tangent_leaves, spec


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
    first_line = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}"
    program = _program_fn(entry, batch, len(zs))
    before.restore()
    try:
        with torch.no_grad():
            program(*zs, *vs)
    except Exception as own:  # noqa: BLE001 - the program fails without the compiler too
        return (f"mixedad's tangent program fails on these inputs ({type(own).__name__}: "
                f"{str(own).strip().splitlines()[0][:300] if str(own).strip() else ''}); please report it with G's code")
    return f"torch.compile failed ({first_line})"
