"""Every random source G may draw from: captured before a pass, replayed after it, compared.

A pass that runs again (a restart, the whole-G fallback, a chunk, ``input_grad``'s backward, a
curvature sweep, the check of a tangent program) must draw what the first pass drew, and a call
must leave every source where one plain forward of G leaves it. :class:`RandomState` holds all
of them:

- torch's global CPU generator, and each initialised CUDA device's;
- Python's ``random`` and NumPy's global generator (``np.random``);
- every ``torch.Generator`` that G's ops receive (as ``generator=`` or by position);
- the random sources G holds: a ``torch.Generator``, a NumPy ``Generator`` or ``RandomState``, a
  ``random.Random`` kept as an attribute of one of G's modules, or in what a function G closes
  over (:mod:`mixedad._ground.reach`): :meth:`RandomState.hold`, by the snapshot of G.

A ``torch.Generator`` G neither holds nor names is known from the first op that receives it inside
:func:`watching` (the watch of :mod:`mixedad._ground.watch` reads each op's arguments; mixedad's
own dispatch reads them itself). Each watching state records a generator's state at first sight,
which is its state before the pass drew from it, and the generators seen for a G are remembered
(weakly, per G), so that every later capture for that G takes their state up front. Other
threads' generators are never touched. Not known: a generator that G drives from code no torch
function sees (a C++ extension drawing from it) and does not hold.

Capturing costs tens of microseconds per snapshot (Python's and NumPy's states are copied in full),
which the default's tangent programs, taking no snapshot, do not pay.
"""
import contextlib
import random
import sys
import threading
import weakref

import torch

from mixedad._ground import watch

__all__ = ["RandomState", "watching", "undone", "is_source", "source_types"]

#: G (or the object a bound method G belongs to) -> the torch.Generators its ops received in a watched pass.
_KNOWN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_KNOWN_LOCK = threading.Lock()


def _numpy_random():
    """NumPy's global generator module, if NumPy is imported (mixedad never imports it for this)."""
    numpy = sys.modules.get("numpy")
    return getattr(numpy, "random", None) if numpy is not None else None


def _same(a, b):
    """Whether two captured states are equal (tuples, dicts and arrays of them, as NumPy and Python give them)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # a NumPy array
        return bool(getattr(a == b, "all", lambda: a == b)())
    return a == b


def _owner(G):
    """The key G's generators are remembered under: G, or the object a bound method of it belongs to."""
    owner = getattr(G, "__self__", G)
    try:
        weakref.ref(owner)
    except TypeError:  # a builtin: nothing remembered
        return None
    return owner


def _accessors(source):
    """``(get_state, set_state)`` for a random source G may hold, or None for any other object."""
    if isinstance(source, torch.Generator):
        return source.get_state, source.set_state
    if isinstance(source, random.Random) and not isinstance(source, random.SystemRandom):  # SystemRandom: no state
        return source.getstate, source.setstate
    numpy_random = _numpy_random()
    if numpy_random is None:
        return None
    if isinstance(source, numpy_random.Generator):
        bits = source.bit_generator
        return (lambda: bits.state), (lambda state: setattr(bits, "state", state))
    if isinstance(source, numpy_random.RandomState):
        return source.get_state, source.set_state
    if isinstance(source, numpy_random.BitGenerator):
        return (lambda: source.state), (lambda state: setattr(source, "state", state))
    return None


_TYPES: list = []  # the random source types, once NumPy's are known (isinstance against one tuple: snapshots ask
# it of every attribute of every module of G, on every call)


def source_types():
    """The types of the random sources a snapshot holds (a tuple for ``isinstance``; SystemRandom is refused by
    :func:`is_source`)."""
    if not _TYPES or (len(_TYPES[0]) == 2 and _numpy_random() is not None):
        numpy_random = _numpy_random()
        numpy_types = ((numpy_random.Generator, numpy_random.RandomState, numpy_random.BitGenerator)
                       if numpy_random is not None else ())
        _TYPES[:] = [(torch.Generator, random.Random, *numpy_types)]
    return _TYPES[0]


def is_source(obj):
    """Whether ``obj`` is a random source a snapshot holds (:meth:`RandomState.hold`)."""
    return isinstance(obj, source_types()) and not isinstance(obj, random.SystemRandom)


class RandomState:
    """The state of every random source G may draw from (the module docstring), at construction.

    Args:
        G: the generator whose generators seen before are captured up front; None for none.
        host: keyword-only; also capture Python's and NumPy's global states (tens of microseconds: NumPy's is copied
            in full). False for a G made of
            ``torch.nn``'s own layers with no hooks, which runs no Python code of the user's that could draw them.

    Generators first seen later, inside :func:`watching` this state, are added at first sight.
    """

    def __init__(self, G=None, *, host=True):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        numpy_random = _numpy_random() if host else None
        self.python = random.getstate() if host else None
        self.numpy = numpy_random.get_state() if numpy_random is not None else None
        self.owner = None if G is None else _owner(G)
        with _KNOWN_LOCK:
            known = list(_KNOWN.get(self.owner, ())) if self.owner is not None else []
        self.generators = {g: g.get_state() for g in known}
        self.held = {}  # id -> (source, state): the sources G holds other than torch generators

    def again(self):
        """The states of the same sources (and of generators G was seen to use since), taken now: for putting them
        back as they are now after passes that replay this state."""
        state = RandomState(self.owner, host=self.python is not None)
        for generator in self.generators:
            state.note(generator)
        for source, _ in self.held.values():
            state.hold(source)
        return state

    def note(self, generator):
        """Record ``generator``'s state now, if this state does not hold it yet (its first sight); every later
        state for the same G captures it up front."""
        if generator not in self.generators:
            if self.owner is not None:
                with _KNOWN_LOCK:
                    _KNOWN.setdefault(self.owner, weakref.WeakSet()).add(generator)
            self.generators[generator] = generator.get_state()

    def hold(self, source):
        """Record the state of a random source G holds (:func:`is_source`), if not recorded yet."""
        if isinstance(source, torch.Generator):
            self.note(source)
        elif id(source) not in self.held:
            self.held[id(source)] = (source, _accessors(source)[0]())

    def restore(self):
        """Put every source back where it was."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.python is not None:
            random.setstate(self.python)
        numpy_random = _numpy_random()
        if self.numpy is not None and numpy_random is not None:
            numpy_random.set_state(self.numpy)
        for generator, state in self.generators.items():
            generator.set_state(state)
        for source, state in self.held.values():
            _accessors(source)[1](state)

    def drawn(self):
        """The sources drawn from since (by name, in the order of the module docstring); empty if none."""
        found = []
        if not torch.equal(torch.get_rng_state(), self.cpu):
            found.append("torch's global generator")
        if self.cuda is None:
            if torch.cuda.is_initialized():  # CUDA started since: assume it drew
                found.append("torch's CUDA generator")
        elif not all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), self.cuda)):
            found.append("torch's CUDA generator")
        if self.python is not None and random.getstate() != self.python:
            found.append("Python's random")
        numpy_random = _numpy_random()
        if numpy_random is not None and self.numpy is not None and not _same(numpy_random.get_state(), self.numpy):
            found.append("NumPy's global generator")
        if any(not torch.equal(g.get_state(), state) for g, state in self.generators.items()):
            found.append("a torch.Generator")
        found += [f"a {type(source).__module__}.{type(source).__name__} G holds" for source, state in self.held.values()
                  if not _same(_accessors(source)[0](), state)]
        return found

    def is_current(self):
        """Whether every source is still where it was (nothing drew random numbers since)."""
        return not self.drawn()


def watching(state, *, mode=True):
    """Inside the block, ``state`` records every generator G's ops receive, at first sight (``mode``: as for
    :func:`mixedad._ground.watch.observing`)."""
    return watch.observing("generators", state, mode=mode)


@contextlib.contextmanager
def undone():
    """Every random source drawn from inside the block is put back after it (a probe, an extra evaluation of f)."""
    state = RandomState()
    try:
        with watching(state):
            yield state
    finally:
        state.restore()
