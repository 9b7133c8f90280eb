"""Peak memory and timing, exact on CPU and read from the allocator on CUDA.

On CPU there are no allocator statistics, so mixedad counts storage bytes itself: a
``TorchDispatchMode`` sees every tensor an ATen op returns while the counter is active, adds the
bytes of each storage it has not seen before, and a ``weakref.finalize`` on the storage
subtracts them when the last owner (a tensor, a view, or autograd's saved tensors) lets it go.
Views, in-place results and other outputs that alias an op's inputs add nothing. The count is
deterministic, so memory claims can be tested exactly in CI without a GPU.
"""
from typing import Any, Callable, Tuple
import statistics
import time
import weakref

import torch
from mixedad._hooks.dispatch import TorchDispatchMode

from mixedad._hooks.pytree import tree_leaves

__all__ = ["StorageCounter", "peak_memory", "cuda_peak_memory", "cpu_peak_memory", "median_time"]


def _storage_key(storage):
    return storage._cdata


class StorageCounter(TorchDispatchMode):
    r"""Context manager counting live bytes of tensor storages allocated inside it.

    .. math::

        \mathrm{peak} = \max_{t}\ \sum_{s\ \text{allocated inside, alive at}\ t} \mathrm{nbytes}(s)

    Counts storages on every device except ``meta``; storages that existed before entering
    are never counted, even when an op returns a view of them. Temporary buffers that an ATen
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

    def __init__(self) -> None:
        super().__init__()
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
        if tensor.is_sparse or tensor.device.type == "meta":
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


def cpu_peak_memory(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Tuple[Any, int]:
    r"""Run ``fn(*args, **kwargs)`` under a :class:`StorageCounter`.

    .. math::

        \mathrm{peak} = \max_{t \in \mathrm{call}}\ \sum_{s\ \text{allocated since the call, alive at}\ t} \mathrm{nbytes}(s)

    Example:
        >>> import torch
        >>> from mixedad.profiling import cpu_peak_memory
        >>> result, peak = cpu_peak_memory(lambda: torch.ones(10, dtype=torch.float64).cumsum(0))
        >>> peak, result[-1].item()
        (160, 10.0)

    Returns:
        ``(result, peak_bytes)``: fn's result and the exact peak of live storage bytes that fn
        allocated (on any device), counted from zero at the call.
    """
    with StorageCounter() as counter:
        result = fn(*args, **kwargs)
    return result, counter.peak


def cuda_peak_memory(fn: Callable[..., Any], *args: Any, device: Any = None, **kwargs: Any) -> Tuple[Any, int]:
    r"""Run ``fn(*args, **kwargs)`` and read the CUDA caching allocator's peak.

    .. math::

        \mathrm{peak} = \max_{t \in \mathrm{call}} \mathrm{allocated}(t) - \mathrm{allocated}(\mathrm{start})

    Example:
        >>> import torch
        >>> from mixedad.profiling import cuda_peak_memory
        >>> _, peak = cuda_peak_memory(torch.zeros, 256, device="cuda")  # doctest: +SKIP
        >>> peak  # doctest: +SKIP
        1024

    Args:
        device: the CUDA device to read (keyword-only; default: the current device).

    Returns:
        ``(result, peak_bytes)``: the peak of ``torch.cuda.max_memory_allocated`` during the call
        minus the bytes allocated before it.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_peak_memory(fn): no CUDA device is available; use cpu_peak_memory.")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn(*args, **kwargs)
    torch.cuda.synchronize(device)
    return result, torch.cuda.max_memory_allocated(device) - before


def _cuda_device_of(objs):
    for obj in tree_leaves(objs):
        if isinstance(obj, torch.nn.Module):
            tensors = list(obj.parameters()) + list(obj.buffers())
        else:
            tensors = [obj]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                return t.device
    return None


def peak_memory(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Tuple[Any, int]:
    r"""Peak memory of ``fn(*args, **kwargs)``, in bytes above what was allocated before it.

    .. math::

        \mathrm{peak} = \max_{t \in \mathrm{call}} \mathrm{allocated}(t) - \mathrm{allocated}(\mathrm{start})

    If any tensor (or nn.Module) among args and kwargs lives on a CUDA device, reads that
    device's caching-allocator peak (:func:`cuda_peak_memory`). Otherwise counts storage bytes
    exactly (:func:`cpu_peak_memory`), which is deterministic and needs no GPU.

    Returns:
        ``(result, peak_bytes)``.

    Example:
        >>> import torch
        >>> from mixedad.profiling import peak_memory
        >>> _, peak = peak_memory(lambda n: torch.zeros(n, dtype=torch.float32), 256)
        >>> peak
        1024
    """
    device = _cuda_device_of((args, kwargs))
    if device is not None:
        return cuda_peak_memory(fn, *args, device=device, **kwargs)
    return cpu_peak_memory(fn, *args, **kwargs)


def median_time(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1) -> float:
    r"""Median wall-clock seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs.

    .. math::

        \mathrm{median}_{r = 1..\mathrm{repeats}}\ t_r

    Synchronizes CUDA around each run when CUDA is initialised. For benchmarks and the demo
    only: wall-clock time on a shared machine is noisy, so compare ratios measured in one run.

    Example:
        >>> from mixedad.profiling import median_time
        >>> median_time(lambda: sum(range(1000)), repeats=3) > 0
        True
    """
    if repeats < 1:
        raise ValueError(f"median_time(fn): expected repeats >= 1, got {repeats}.")
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
