"""Every random source G may draw from: captured before a pass, replayed after it, compared.

A pass that runs again (a restart, the whole-G fallback, a chunk, ``input_grad``'s backward, a
curvature sweep, the check of a tangent program) must draw what the first pass drew, and a call
must leave every source where one plain forward of G leaves it. :class:`RandomState` holds all
of them:

- torch's global CPU generator, and each initialised CUDA device's;
- Python's ``random`` and NumPy's global generator (``np.random``);
- every ``torch.Generator`` that G's ops receive as ``generator=``.

A ``torch.Generator`` cannot be found before G uses it: it is known from the first op that
receives it inside :func:`watching` (the watch of :mod:`mixedad._frontend.watch` reads each op's
``generator`` argument; mixedad's own dispatch reads it itself). Each watching state records a generator's state at first sight,
which is its state before the pass drew from it, and known generators are remembered for the
process (weakly), so that every later capture takes their state up front. A generator that G
drives from code no torch function sees (a C++ extension drawing from it) is not known.

Capturing costs tens of microseconds per snapshot (Python's and NumPy's states are copied in full),
which the default's tangent programs, taking no snapshot, do not pay.
"""
import contextlib
import random
import sys
import threading
import weakref

import torch

from mixedad._frontend import watch

__all__ = ["RandomState", "watching", "undone"]

#: Every torch.Generator an op of G received inside a watched pass, for the whole process (weakly held).
_KNOWN: "weakref.WeakSet[torch.Generator]" = weakref.WeakSet()
_KNOWN_LOCK = threading.Lock()


def _numpy_random():
    """NumPy's global generator module, if NumPy is imported (mixedad never imports it for this)."""
    numpy = sys.modules.get("numpy")
    return getattr(numpy, "random", None) if numpy is not None else None


def _same_numpy(a, b):
    if a is None or b is None:
        return a is b
    return a[0] == b[0] and (a[1] == b[1]).all() and a[2:] == b[2:]


class RandomState:
    """The state of every random source G may draw from (the module docstring), at construction.

    Generators first seen later, inside :func:`watching` this state, are added at first sight.
    """

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.python = random.getstate()
        numpy_random = _numpy_random()
        self.numpy = numpy_random.get_state() if numpy_random is not None else None
        with _KNOWN_LOCK:
            known = list(_KNOWN)
        self.generators = {g: g.get_state() for g in known}

    def note(self, generator):
        """Record ``generator``'s state now, if this state does not hold it yet (its first sight); every later
        state captures it up front."""
        if generator not in self.generators:
            with _KNOWN_LOCK:
                _KNOWN.add(generator)
            self.generators[generator] = generator.get_state()

    def restore(self):
        """Put every source back where it was."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        numpy_random = _numpy_random()
        if self.numpy is not None and numpy_random is not None:
            numpy_random.set_state(self.numpy)
        for generator, state in self.generators.items():
            generator.set_state(state)

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
        if random.getstate() != self.python:
            found.append("Python's random")
        numpy_random = _numpy_random()
        if numpy_random is not None and not _same_numpy(numpy_random.get_state(), self.numpy):
            found.append("NumPy's global generator")
        if any(not torch.equal(g.get_state(), state) for g, state in self.generators.items()):
            found.append("a torch.Generator")
        return found

    def is_current(self):
        """Whether every source is still where it was (nothing drew random numbers since)."""
        return not self.drawn()


def watching(state):
    """Inside the block, ``state`` records every generator G's ops receive, at first sight."""
    return watch.observing("generators", state)


@contextlib.contextmanager
def undone():
    """Every random source drawn from inside the block is put back after it (a probe, an extra evaluation of f)."""
    state = RandomState()
    try:
        with watching(state):
            yield state
    finally:
        state.restore()
