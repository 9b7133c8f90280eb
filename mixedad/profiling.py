"""Peak memory and timing, exact on CPU and read from the allocator on CUDA.

On CPU there are no allocator statistics, so mixedad counts storage bytes itself: a
``TorchDispatchMode`` sees every tensor an ATen op returns while the counter is active, adds the
bytes of each storage it has not seen before, and a ``weakref.finalize`` on the storage
subtracts them when the last owner (a tensor, a view, or autograd's saved tensors) lets it go.
Views, in-place results and other outputs that alias an op's inputs add nothing. The count is
deterministic, so memory claims can be tested exactly in CI without a GPU.
"""
from typing import Any, Callable, Dict, Sequence, Tuple
import statistics
import time
import weakref

import torch
from mixedad._hooks.dispatch import TorchDispatchMode

from mixedad._hooks.pytree import tree_leaves
from mixedad._hooks.zero_tensors import inside_meta_kernel
from mixedad._planner.meta import PlanError

__all__ = ["StorageCounter", "peak_memory", "cuda_peak_memory", "cpu_peak_memory", "median_time", "plan", "Plan",
           "PlanError", "PLAN_METHODS", "CUDNN_WORKSPACE", "plan_model", "plan_models"]


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


class _PlanCounter(StorageCounter):
    """A meta :class:`StorageCounter` that names the op when one cannot run on meta tensors, notes whether a
    convolution ran (``convolutions``), and leaves out the meta ops PyTorch's zero-tensor kernels run on every device
    (:mod:`mixedad._hooks.zero_tensors`), which a device run does not count either."""

    convolutions = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in _CONVOLUTIONS:
            self.convolutions = True
        if inside_meta_kernel(func):  # meta on every device: a device run counts nothing here either
            return func(*args, **(kwargs or {}))
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except (RuntimeError, NotImplementedError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise PlanError(
                f"plan: {func} cannot run on meta tensors ({first}). If the same call fails on real tensors (shapes "
                f"that do not match, a tensor made on another device inside G), fix that first. Otherwise: a plan "
                f"knows sizes, not values, and an op that reads a value (.item(), a bool of a tensor) or makes a "
                f"shape from values (nonzero, unique, masked_select, boolean-mask indexing) has no meta kernel; plan "
                f"a G without it (pass the mask or the count as an argument), or measure on a real device with "
                f"peak_memory.") from error


_CONVOLUTIONS = (torch.ops.aten.convolution, torch.ops.aten.convolution_backward)
#: What a CUDA plan of a G with convolutions adds to its table (:attr:`Plan.notes`).
CUDNN_WORKSPACE = ("cuDNN's convolution workspace is not in this plan (cuDNN picks it at run time): on an H200 "
                   "a DCGAN's forward peaked 1.56x its plan, mixed_grad 1.06x, double backward 1.24x; leave room, "
                   "or plan for torch.backends.cudnn.enabled = False (PyTorch's own kernels: within 2%)")


def _plain_forward(f, G, zs, y):
    with torch.no_grad():
        return G(*zs)


def _mixed_grad(f, G, zs, y):
    from mixedad.mixed import mixed_grad

    return mixed_grad(f, G, zs, y)


def _double_backward(f, G, zs, y):
    from mixedad.reference import double_backward_mixed_grad

    return double_backward_mixed_grad(f, G, zs, y)


def _input_grad(f, G, zs, y):
    from mixedad.input_grad import input_grad

    return input_grad(f, G, zs[0] if len(zs) == 1 else zs, y)


#: What :func:`plan` can measure: method name -> ``fn(f, G, zs, y)``.
PLAN_METHODS: Dict[str, Callable[..., Any]] = {
    "forward": _plain_forward, "mixed_grad": _mixed_grad, "double_backward": _double_backward,
    "input_grad": _input_grad,
}
#: The cards :class:`Plan`'s table shows, in GiB.
CARDS = (24, 40, 80)


class Plan:
    r"""Predicted peak memory of each method, from one run on meta tensors (:func:`plan`).

    .. math::

        \mathrm{fits}(m, c) = \big[\,\mathrm{peak}(m)\,(1 + h) \le c \cdot 2^{30}\,\big]

    Attributes:
        peaks: method -> bytes (exact live storage bytes, as :class:`StorageCounter` counts them).
        device: the device whose kernel choices were emulated.
        seconds: method -> seconds the plan of that method took.
        notes: what the peaks leave out for this G and device (:data:`CUDNN_WORKSPACE` for a CUDA plan
            of a G that convolves); printed under the table.

    Example:
        >>> import torch, mixedad
        >>> G = mixedad.zoo.mlp(2, 8)
        >>> p = mixedad.profiling.plan(lambda y, g: (g * y).sum(), G, torch.randn(4, 8), torch.randn(4, 8))
        >>> sorted(p.peaks), p.fits(80)["mixed_grad"]
        (['double_backward', 'forward', 'mixed_grad'], True)
    """

    def __init__(self, peaks: Dict[str, int], device: str, seconds: Dict[str, float],
                 notes: Sequence[str] = ()) -> None:
        self.peaks, self.device, self.seconds, self.notes = dict(peaks), device, dict(seconds), tuple(notes)

    def fits(self, gib: float, *, headroom: float = 0.0) -> Dict[str, bool]:
        """Method -> whether its peak, plus ``headroom`` (a fraction, for the allocator), fits in ``gib`` GiB."""
        return {m: peak * (1 + headroom) <= gib * 2**30 for m, peak in self.peaks.items()}

    def __str__(self) -> str:
        header = ["method", "peak", *[f"fits {c} GiB" for c in CARDS]]
        rows = [[m, _gib(p), *["yes" if p <= c * 2**30 else "no" for c in CARDS]] for m, p in self.peaks.items()]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
        note = (f"exact live bytes on meta, {self.device}'s kernel choices; a CUDA allocator adds its rounding "
                f"and cache on top (leave a few percent)")
        return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows), note, *self.notes])

    def __repr__(self) -> str:
        return f"Plan({', '.join(f'{m}={_gib(p)}' for m, p in self.peaks.items())}, device={self.device!r})"


def _gib(nbytes):
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**27 else f"{nbytes / 2**20:.2f} MiB"


def plan(f: Callable[..., torch.Tensor], G: Callable[..., Any], z: Any, y: Any, *,
         methods: Sequence[str] = ("forward", "mixed_grad", "double_backward"), device: str = "cuda") -> Plan:
    r"""Predict each method's peak memory on ``device`` without running it there: one run on meta tensors.

    .. math::

        \mathrm{peak}(m) = \max_t \sum_{s\ \text{alive at}\ t} \mathrm{nbytes}(s)
        \quad\text{over the meta run of } m

    G, z and y are copied to meta (sizes and dtypes, no memory, no values): a module runs with
    meta parameters and buffers in place of its own (``torch.func.functional_call``), so G is left
    untouched; a G built under ``torch.device("meta")`` runs as it is. Each method runs once on
    those copies under an exact storage count, with ``device``'s fused attention emulated
    (:mod:`mixedad._planner.target`) and its kernels' output layouts (:mod:`mixedad._planner.layouts`:
    a convolution of a channels-last input stays channels-last on the CPU and with cuDNN); the meta
    ops PyTorch runs inside its zero-tensor kernels, on every device, are not counted. mixedad's
    per-op rules take the same paths on meta as on real tensors. On CPU-sized generators the plan
    equals :func:`peak_memory` within 2% (tested); a CUDA allocator adds its block rounding and
    cache on top of these live bytes.

    Args:
        f, G, z, y: as for :func:`mixedad.mixed_grad`; tensors anywhere (they are not read).
        methods: keyword-only; names from :data:`PLAN_METHODS`: "forward" (G(z) under no_grad),
            "mixed_grad", "double_backward" (the naive create_graph code), "input_grad".
        device: keyword-only; "cuda" or "cpu", whose kernel choices to emulate.

    Returns:
        A :class:`Plan`; ``print(plan)`` shows the table and the cards each method fits on.

    Raises:
        PlanError: an op of G that cannot run on meta tensors (named), or G closing over real tensors
            (but for the masks it passes to ``F.scaled_dot_product_attention``: one stands as its shape on
            ``device``).
        ValueError: an unknown method or device.

    Example:
        >>> import torch, mixedad
        >>> with torch.device("meta"):
        ...     G = mixedad.zoo.mlp(64, 4096)      # 64 layers of width 4096: nothing allocated
        >>> z = torch.empty(256, 4096, device="meta")
        >>> p = mixedad.profiling.plan(lambda y, g: ((g - y) ** 2).sum(), G, z, z)
        >>> p.peaks["double_backward"] > 10 * p.peaks["mixed_grad"]
        True
    """
    import time

    from mixedad import _checks
    from mixedad._planner.meta import meta_generator, meta_tree
    from mixedad._frontend.state import Snapshot
    from mixedad._planner.layouts import TargetLayouts
    from mixedad._planner.target import DEVICES, TargetDevice, planning_for
    from mixedad.op_rules._probes import new_plan

    call = "plan(f, G, z, y)"
    if isinstance(methods, str):
        methods = (methods,)
    unknown = [m for m in methods if m not in PLAN_METHODS]
    if unknown or not methods:
        raise ValueError(f"{call}: expected methods from {sorted(PLAN_METHODS)}, got {list(methods)!r}.")
    if device not in DEVICES:
        raise ValueError(f"{call}: expected device in {DEVICES}, got {device!r}.")
    _checks.check_callable(call, "f", f)
    _checks.check_callable(call, "G", G)
    zs = meta_tree(_checks.flatten_z(call, z))
    y_meta = meta_tree(y)
    G_meta = meta_generator(call, G)
    peaks, seconds, convolutions = {}, {}, False
    # Random ops on meta still advance the generators, and G may set attributes as it runs (a cache built on
    # first use, a weight an old-style norm hook recomputes): they would hold meta tensors after the plan.
    snapshot = Snapshot(G, call=call)
    try:
        with snapshot.watching():
            for method in methods:
                start = time.perf_counter()
                new_plan()  # each method's run counts the probes of a first call
                with TargetDevice(device), planning_for(device), TargetLayouts(device), \
                        _PlanCounter(meta=True) as counter:
                    PLAN_METHODS[method](f, G_meta, zs, y_meta)
                peaks[method], seconds[method] = counter.peak, time.perf_counter() - start
                convolutions = convolutions or counter.convolutions
    finally:
        snapshot.restore()
    return Plan(peaks, device, seconds, (CUDNN_WORKSPACE,) if convolutions and device == "cuda" else ())


def plan_models() -> Tuple[str, ...]:
    r"""The names :func:`plan_model` (and ``python -m mixedad plan``) builds at real sizes.

    .. math::

        \{\text{stylegan2}, \text{dcgan}, \text{vq\_decoder}, \text{mlp}, \text{gpt2-medium}, \text{sd-vae}\}

    Example:
        >>> import mixedad
        >>> "gpt2-medium" in mixedad.profiling.plan_models()
        True
    """
    from mixedad._planner.models import PLAN_MODELS

    return tuple(sorted(PLAN_MODELS))


def plan_model(name: str, *, batch: int, resolution: int, dtype: torch.dtype = torch.float16, device: str = "cuda",
               methods: Sequence[str] = ("forward", "mixed_grad", "double_backward")) -> Tuple[Plan, str]:
    r"""Build a generator of :func:`plan_models` on meta at its real size and :func:`plan` it.

    .. math::

        \mathrm{plan}\big(f, G_{\text{meta}}, z_{\text{meta}}, y_{\text{meta}}\big), \qquad
        f(y, g) = \lVert g - y \rVert^2

    Random-weight configurations, nothing downloaded: the zoo's generators at full size, a
    StyleGAN2-like G of custom Functions, GPT-2-medium (needs transformers) and the Stable
    Diffusion VAE decoder (needs diffusers). ``resolution`` is the image side, or the number of
    tokens for GPT-2.

    Returns:
        ``(plan, description)``.

    Example:
        >>> import torch, mixedad
        >>> p, what = mixedad.profiling.plan_model("dcgan", batch=2, resolution=64, dtype=torch.float32)
        >>> p.peaks["double_backward"] > p.peaks["mixed_grad"]
        True
    """
    from mixedad._planner.models import build

    G, z, y, what = build(name, batch, resolution, dtype)
    return plan(lambda y_, g: ((g - y_) ** 2).sum(), G, z, y, methods=methods, device=device), what
