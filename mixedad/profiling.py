"""Peak memory and timing, exact on CPU and read from the allocator on CUDA; memory plans on meta tensors.

On CPU there are no allocator statistics, so mixedad counts storage bytes itself
(:class:`StorageCounter`): every storage an ATen op returns while the counter is active, until its
last owner lets it go. The count is deterministic, so memory claims can be tested exactly in CI
without a GPU. :func:`plan` predicts each method's peak on a device from one run on meta tensors.
The counting and the plans live in :mod:`mixedad._planner`; this module is their public face, with
the measurements on real devices.
"""
from typing import Any, Callable, Tuple
import statistics
import time

import torch

from mixedad._hooks.pytree import tree_leaves
from mixedad._planner.meta import PlanError
from mixedad._planner.plan import CARDS, CUDNN_WORKSPACE, PLAN_METHODS, Plan, plan, plan_model, plan_models
from mixedad._planner.storage import StorageCounter

__all__ = ["StorageCounter", "peak_memory", "cuda_peak_memory", "cpu_peak_memory", "median_time", "plan", "Plan",
           "PlanError", "PLAN_METHODS", "CARDS", "CUDNN_WORKSPACE", "plan_model", "plan_models"]


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
