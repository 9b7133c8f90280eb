"""One torch-function mode that sees a pass's ops before they run, for what mixedad records at first sight.

Two kinds of observers register here, per thread, and share one mode (nested watches push no
second one):

- **random states** (:class:`mixedad._ground.random_state.RandomState`): every
  ``torch.Generator`` an op receives (``generator=``, or by position), its state noted before it
  first draws;
- **reads** (:class:`Reads`, for :mod:`mixedad._ground.versions`): every tensor an op reads that
  the pass did not make (a tensor G closes over, a parameter as G passes it);
- **guards** (:class:`WriteGuard`): ops about to write in place into tensors a pass must not
  change, refused before they run.

mixedad's own dispatch (:class:`mixedad.op_rules.OpRules`) notes generators itself and takes the
mode off while it runs (:func:`off`), one mode fewer on every op of the per-op pass; reads are only
watched in the passes a saved object records (reverse passes and plain ones), where the mode stays.
"""
import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from mixedad._ground.writes import in_place_targets
from mixedad._hooks.pytree import tree_flatten
from mixedad._hooks.tensor_kinds import storage_id
from mixedad._hooks.torch_function_stack import innermost, popped

__all__ = ["Reads", "WriteGuard", "handed", "observing", "ops", "off", "note_generators", "generator_observers"]

_local = threading.local()


def _observers(kind):
    found = getattr(_local, kind, None)
    if found is None:
        found = []
        setattr(_local, kind, found)
    return found


def generator_observers():
    """The random states watching in this thread (each has ``note(generator)``)."""
    return getattr(_local, "generators", None) or ()


def note_generators(args, kwargs):
    """The generators an op receives (``generator=``, or by position: ``torch.poisson(rates, g)``): every watching
    random state records each at first sight. On every op of mixedad's per-op pass: no allocation."""
    observers = getattr(_local, "generators", None)
    if not observers:
        return
    for a in args:
        if type(a) is _GENERATOR:
            for state in observers:
                state.note(a)
    if kwargs:
        generator = kwargs.get("generator")
        if isinstance(generator, _GENERATOR):
            for state in observers:
                state.note(generator)


_GENERATOR, _TENSOR = torch.Generator, torch.Tensor


class _Watch(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads = getattr(_local, "reads", None)
        if not reads:
            note_generators(args, kwargs)
            for guard in getattr(_local, "guards", None) or ():
                guard.before(func, args, kwargs)
            return func(*args, **kwargs)
        # One scan of the arguments for both (this runs on every op of a watched pass).
        observers, tensors = getattr(_local, "generators", None), []
        for value in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(value, _TENSOR):
                tensors.append(value)
            elif type(value) is tuple or type(value) is list:
                tensors += [t for t in value if isinstance(t, _TENSOR)]
            elif isinstance(value, _GENERATOR):
                for state in observers or ():
                    state.note(value)
        for guard in getattr(_local, "guards", None) or ():
            guard.before(func, args, kwargs)
        for r in reads:
            r.read(tensors)
        out = func(*args, **kwargs)
        for r in reads:
            r.made(out)
        return out


class Reads:
    """The tensors a pass's ops read that the pass did not make.

    Attributes:
        tensors: those tensors, in the order first read (held: G, or what it closes over, holds them anyway).
    """

    def __init__(self):
        self.tensors = []
        # By id (a tensor's == is elementwise). The id of a made tensor that died may come back as another tensor's,
        # one made inside the pass too (a tensor alive when the pass started never shares an id with one made
        # later) and not by an op: such a tensor is not listed, and it is no state of G that a replay reads again.
        self._seen, self._made = set(), set()

    def read(self, tensors):
        """Note ``tensors``, an op's tensor arguments."""
        seen, made = self._seen, self._made
        for t in tensors:
            i = id(t)
            if i not in seen and i not in made:
                seen.add(i)
                self.tensors.append(t)

    def made(self, out):
        """Note what an op returned as made by the pass."""
        if isinstance(out, _TENSOR):
            self._made.add(id(out))
        else:
            self._made.update(map(id, _tensors(out, None)))


def handed(*trees):
    """The tensors of ``trees`` (G's or f's arguments, as mixedad hands them over) count as made by the pass for
    every :class:`Reads` of this thread: what a pass reads of them is its own, or an input its owner checks apart
    (z, y), never state G or f closes over."""
    readers = getattr(_local, "reads", None)
    if readers:
        made = [id(t) for t in tree_flatten(trees)[0] if isinstance(t, torch.Tensor)]
        for reads in readers:
            reads._made.update(made)


class WriteGuard:
    """Calls ``refuse(op name)`` before an op writes in place into the memory of any of ``tensors``."""

    def __init__(self, tensors, refuse):
        self._storages = {storage_id(t) for t in tensors if isinstance(t, torch.Tensor) and t.layout == torch.strided}
        self.refuse = refuse

    def before(self, func, args, kwargs):
        targets = in_place_targets(func, args, kwargs)
        if any(t.layout == torch.strided and storage_id(t) in self._storages for t in targets):
            self.refuse(getattr(func, "__name__", repr(func)))


def _tensors(args, kwargs):
    """The tensors among ``args`` and ``kwargs``, and one level into their lists and tuples (``torch.cat``)."""
    for value in (*(args if isinstance(args, (tuple, list)) else (args,)), *(kwargs.values() if kwargs else ())):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from (t for t in value if isinstance(t, torch.Tensor))


@contextlib.contextmanager
def observing(kind, observer, *, mode=True):
    """Inside the block, ``observer`` sees the ops of this thread (``kind``: "generators", "reads" or "guards").

    Without ``mode``, the watch mode is not started for the block: for a pass whose own dispatch notes every op
    (mixedad's per-op pass), which would only take it off again (code below the dispatch starts one: :func:`ops`).
    """
    observers = _observers(kind)
    observers.append(observer)
    try:
        with ops() if mode else contextlib.nullcontext():
            yield observer
    finally:
        observers.remove(observer)


@contextlib.contextmanager
def ops():
    """The mode on for the block, where observers are registered and no mode of this thread runs yet (code below
    mixedad's dispatch, such as a custom Function's forward, after :func:`off`)."""
    if getattr(_local, "mode", None) is not None or not (generator_observers() or getattr(_local, "reads", None)
                                                           or getattr(_local, "guards", None)):
        yield
        return
    _local.mode = mode = _Watch()
    try:
        with mode:
            yield
    finally:
        _local.mode = None


@contextlib.contextmanager
def off():
    """The mode off for the block, where it is the innermost torch-function mode and no reads are watched: for a
    pass whose own dispatch notes every op's generator (one mode fewer on every op), and for a tangent program,
    which draws no random numbers and runs with no torch-function mode. Watches inside the block start a mode
    of their own."""
    mode = getattr(_local, "mode", None)
    if mode is None or getattr(_local, "reads", None) or getattr(_local, "guards", None) or not innermost(mode):
        yield  # nothing to take off, reads or writes to watch, or another mode above it (which the ops reach first)
        return
    with popped(mode):
        _local.mode = None
        try:
            yield
        finally:
            _local.mode = mode
