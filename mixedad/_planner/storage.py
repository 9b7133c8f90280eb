"""Exact live bytes of tensor storages: the count behind :func:`mixedad.profiling.peak_memory` on the CPU and behind plans.

On CPU there are no allocator statistics, so mixedad counts storage bytes itself: a
``TorchDispatchMode`` sees every tensor an ATen op returns while the counter is active, adds the
bytes of each storage it has not seen before, and a ``weakref.finalize`` on the storage
subtracts them when the last owner (a tensor, a view, or autograd's saved tensors) lets it go.
Views, in-place results and other outputs that alias an op's inputs add nothing. The count is
deterministic, so memory claims can be tested exactly in CI without a GPU. A plan
(:mod:`mixedad._planner.plan`) counts the same way on meta tensors.
"""
from typing import Any
import weakref

import torch

from mixedad._hooks.dispatch_modes import TorchDispatchMode
from mixedad._hooks.pytree import tree_leaves

__all__ = ["StorageCounter"]


def _storage_key(storage):
    return storage._cdata


class StorageCounter(TorchDispatchMode):
    r"""Context manager counting live bytes of tensor storages allocated inside it.

    .. math::

        \mathrm{peak} = \max_{t}\ \sum_{s\ \text{allocated inside, alive at}\ t} \mathrm{nbytes}(s)

    Counts storages on every device except ``meta`` (with ``meta=True``, on meta too: a plan's
    count, where storages hold no memory but have their sizes); storages that existed before
    entering are never counted, even when an op returns a view of them. Zero tensors (PyTorch's
    storage-free zeros for absent tangents) are never counted. Temporary buffers that an ATen
    kernel allocates and frees inside itself are invisible, so the count is a lower bound on
    what the allocator sees, and equal to it for ordinary tensor programs.

    Attributes:
        current: bytes allocated inside the block and still alive.
        peak: the largest ``current`` seen while the block ran.

    Example:
        >>> import torch
        >>> from mixedad.profiling import StorageCounter
        >>> with StorageCounter() as counter:
        ...     a = torch.ones(1000, dtype=torch.float64)
        ...     b = a.view(10, 100) * 2
        ...     del a, b
        >>> counter.peak, counter.current
        (16000, 0)
    """

    #: It only watches: mixedad's tangent programs run under it as they run without it.
    observes_only = True

    def __init__(self, *, meta: bool = False) -> None:
        super().__init__()
        self.meta = meta
        self.current = 0
        self.peak = 0
        self._live: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            _storage_key(t.untyped_storage())
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not t.is_sparse
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out

    def _track(self, tensor, inputs):
        if tensor.is_sparse or (tensor.device.type == "meta" and not self.meta) or tensor._is_zerotensor():
            return
        storage = tensor.untyped_storage()
        key = _storage_key(storage)
        nbytes = storage.nbytes()
        if nbytes == 0 or key in inputs or key in self._live:
            return
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self._live[key] = weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key, nbytes):
        self._live.pop(key, None)
        self.current -= nbytes

    def __exit__(self, *exc: Any) -> None:
        result = super().__exit__(*exc)
        # Storages still alive (the result, say) stay counted in ``current``; stop watching them
        # so nothing runs after the block.
        for fin in self._live.values():
            fin.detach()
        self._live.clear()
        return result
