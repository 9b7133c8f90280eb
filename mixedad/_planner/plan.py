"""Memory plans: each method's peak memory on a device, predicted from one run on meta tensors (:func:`plan`).

The public face is :mod:`mixedad.profiling`, which re-exports :func:`plan`, :class:`Plan`,
:func:`plan_model`, :func:`plan_models` and the tables below.
"""
import time
from typing import Any, Callable, Dict, Sequence, Tuple

import torch

from mixedad._hooks.zero_tensors import inside_meta_kernel
from mixedad._planner.meta import PlanError
from mixedad._planner.storage import StorageCounter

__all__ = ["plan", "Plan", "PlanError", "PLAN_METHODS", "CARDS", "CUDNN_WORKSPACE", "plan_model", "plan_models"]


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
        peaks: method -> bytes (exact live storage bytes, as :class:`~mixedad.profiling.StorageCounter` counts them).
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
    equals :func:`~mixedad.profiling.peak_memory` within 2% (tested); a CUDA allocator adds its block rounding and
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
    from mixedad import _checks
    from mixedad._planner.meta import meta_generator, meta_tree
    from mixedad._ground.state import Snapshot
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
