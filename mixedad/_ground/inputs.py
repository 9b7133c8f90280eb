"""G's inputs in a pass: the caller's z and v, until an op of G would write into one of them.

A pass hands G views of the caller's tensors, with no copy (a copy would cost z's memory on every
call). Before an op of G writes in place into the memory of any of them (``q.mul_(2)`` on G's
input, ``nn.ReLU(inplace=True)`` as G's first layer, a write into a view of it), the pass stops
and starts again on mixedad's own copies (:class:`~mixedad._ground.errors.InputsWritten`). So
the caller's v is never written (its next call with the same v would be wrong), nor is z: the
copy takes G's writes, and every pass and replay of the call starts from the z the first one saw.
The writes are read from each call before it runs (:mod:`mixedad._ground.writes`); a custom
Function with its own ``jvp``, whose writes cannot be read, gets the copies whenever it takes one
of the inputs directly.
"""
import torch

from mixedad._hooks.dual_level import unpack
from mixedad._hooks.functorch import NotLowerable, is_wrapped
from mixedad._hooks.tensor_kinds import shares_memory_within, storage_id
from mixedad._ground.writes import in_place_targets, may_write
from mixedad._ground.errors import InputsWritten
from mixedad._ground.naming import op_name

__all__ = ["PassInputs", "own_memory"]


def own_memory(t):
    """``t`` detached; copied when its elements share memory (``expand``), which dual tensors refuse."""
    t = t.detach()
    return t.clone() if shares_memory_within(t) else t


class PassInputs:
    """The primals ``zs`` and tangents ``vs`` a pass hands G: the caller's, or mixedad's copies once G writes one.

    Attributes:
        private: whether G gets copies (set when an op of G was about to write into the caller's).
    """

    def __init__(self, zs, vs):
        self.zs, self.vs = list(zs), list(vs)
        self.private = False
        # (a torch.func transform's tensors have no storage of their own: the caller's transform runs that pass)
        self._storages = frozenset(storage_id(t) for t in (*self.zs, *self.vs)
                                   if t.layout == torch.strided and not is_wrapped(t))

    def primals(self):
        """The z's to hand G in this attempt."""
        return [z.detach().clone() if self.private else own_memory(z) for z in self.zs]

    def tangents(self):
        """The v's to hand G in this attempt."""
        return [v.detach().clone() if self.private else own_memory(v) for v in self.vs]

    def watch(self, func, args, kwargs, batch=None):
        """Before ``func(*args, **kwargs)`` runs: raise InputsWritten where it writes into the caller's z or v."""
        if not self.private and may_write(func, kwargs):
            targets = in_place_targets(func, args, kwargs)
            if targets:
                self.watch_targets(op_name(func), targets, batch)

    def watch_targets(self, name, targets, batch=None):
        """Raise InputsWritten where one of ``targets`` (about to be written) views the caller's z or v."""
        if self.private or not any(self._views_an_input(t, batch) for t in targets):
            return
        self.private = True
        raise InputsWritten(name)

    def _views_an_input(self, t, batch):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return False
        primal, tangent = unpack(t)
        if batch is not None:  # the plain tensors behind a batched pass's (a tangent of the user's vmap over v)
            try:
                primal = batch.lower_primal(primal)
                tangent = None if tangent is None else batch.lower_tangent(tangent, primal)
            except NotLowerable:
                return False
            with batch.plain():
                return any(storage_id(x) in self._storages for x in (primal, tangent) if x is not None)
        return any(storage_id(x) in self._storages for x in (primal, tangent) if x is not None)


def writable(tensors):
    """Copies of ``tensors`` for G (or a segment of it) to take in a reverse pass.

    G may write into its input in place, as a plain forward of it does. Autograd refuses that on a
    leaf that requires grad, and the write must reach neither the caller's z nor a tensor mixedad
    keeps (a curvature sweep's boundaries). A non-leaf copy takes it, and autograd differentiates
    through the write to the leaf. The copy lives only as long as G's first op needs it, which adds
    nothing to a reverse pass's peak but where that op saves its input.
    """
    return [t.clone() for t in tensors]


def on_inputs(fn, tensors, *, copies, refuse):
    """``fn(*tensors)`` in a reverse pass that repeats one seen before: on copies (:func:`writable`) where ``copies``
    (fn wrote its input when it first ran), else on ``tensors`` themselves, so that no copy its first op saves adds
    to the graph; ``refuse(index)`` is called (and raises) if fn then writes one of them after all."""
    if copies:
        return fn(*writable(tensors))
    versions = [t._version for t in tensors]
    out = fn(*tensors)
    for i, (t, version) in enumerate(zip(tensors, versions)):
        if t._version != version:
            refuse(i)
    return out
