r"""The target device's output layouts, given to meta tensors: one rule per op, in one table.

Meta's kernels give some outputs another layout than the device's kernels give them. The bytes of
that output are the same, but every op after it follows its layout: a contiguous copy the device
makes (``reshape``, ``contiguous``, a kernel that needs one) where meta makes none, or none where
meta makes one: without these rules a diffusers ``AutoencoderKL`` decoder (whose attention returns
channels-last activations, which CPU convolutions keep) was planned below its CPU peak
(docs/performance.md, "Measurements behind the design").

.. math::

    \mathrm{layout}(\mathrm{op}_{\mathrm{meta}}(x)) := \mathrm{layout}(\mathrm{op}_{\mathrm{device}}(x))

:class:`TargetLayouts` is a dispatch mode under the plan's byte counter: each op in
:data:`LAYOUTS` runs on meta as before, and its outputs are given the device's layout before the
counter sees them (the meta output it replaces was never counted). The rules (the layout, and for
one op the dtype and size, of what the device allocates):

- ``convolution`` and ``convolution_backward`` (output, ``grad_input``, ``grad_weight``): the
  memory format the device's backend gives (:func:`mixedad._hooks.conv_layouts.conv_memory_format`:
  ATen's own choice on the CPU, cuDNN's rule on CUDA);
- on the CPU, ``native_batch_norm``'s saved statistics in the dtype and size the CPU gives them
  (its parameters' dtype, and none in eval mode; meta's: float32, one per channel);
- on the CPU, ``native_group_norm`` and its backward, ``pixel_shuffle``, ``pixel_unshuffle`` and
  the reflection and replication pads and their backward keep their input's suggested memory
  format (meta's kernels are contiguous; ``F.group_norm`` itself, whose CPU composite keeps the
  layout, is emulated by :class:`~mixedad._planner.target.TargetDevice`), and so do the copies of
  group norm's first-order backward formula (``clone`` inside ``NativeGroupNormBackward0``: to
  contiguous on every other device, meta included; none for a channels-last tensor on the CPU).

On CUDA, the layouts of ops other than convolutions take meta's (contiguous, as CUDA's group norm
is).
"""
import torch

from mixedad._hooks.backward_node import running_backward
from mixedad._hooks.conv_layouts import conv_memory_format, in_memory_format, suggest_memory_format
from mixedad._hooks.dispatch_modes import TorchDispatchMode
from mixedad._hooks.pytree import tree_leaves

__all__ = ["TargetLayouts", "LAYOUTS"]

aten = torch.ops.aten


def _bound(func, args, kwargs):
    return {**dict(zip((a.name for a in func._schema.arguments), args)), **kwargs}


def _conv_format(device, a):
    bias = a.get("bias")
    bias_sizes = list(bias.shape) if bias is not None else a.get("bias_sizes")
    return conv_memory_format(device, a["input"], a["weight"], bias_sizes, a["stride"], a["padding"], a["dilation"],
                              a["transposed"], a["output_padding"], a["groups"])


def _convolution(device, a, out):
    return in_memory_format(out, _conv_format(device, a))


def _convolution_backward(device, a, out):
    grad_input, grad_weight, grad_bias = out
    fmt = _conv_format(device, a)
    return (None if grad_input is None else in_memory_format(grad_input, fmt),
            None if grad_weight is None else in_memory_format(grad_weight, fmt), grad_bias)


def _cpu_keeps(name):
    """The CPU kernel's output(s) in the suggested memory format of argument ``name`` (the first output only where
    the op returns several)."""

    def rule(device, a, out):
        if device != "cpu":
            return out
        fmt = suggest_memory_format(a[name])
        if isinstance(out, torch.Tensor):
            return in_memory_format(out, fmt)
        return (None if out[0] is None else in_memory_format(out[0], fmt), *out[1:])

    return rule


def _cpu_batch_norm(device, a, out):
    """The CPU's saved statistics: in its parameters' dtype (the input's, where it has none; meta: float32), and
    empty in eval mode (meta: one per channel)."""
    if device != "cpu":
        return out
    x = a["input"]
    params = [a.get(name) for name in ("weight", "running_mean")]
    dtype = next((t.dtype for t in params if t is not None), x.dtype)
    size = x.shape[1] if a["training"] else 0
    return (out[0], *(torch.empty(size, dtype=dtype, device=x.device) for _ in range(2)))


def _cpu_group_norm_backward_copy(device, a, out):
    """Group norm's first-order backward formula copies its gradient and saved input to contiguous tensors on every
    device but the CPU, where it keeps their suggested memory format (a channels-last one stays)."""
    if device != "cpu" or running_backward() != "NativeGroupNormBackward0" or \
            a.get("memory_format") != torch.contiguous_format:
        return out
    return a["self"].contiguous(memory_format=suggest_memory_format(a["self"]))


#: aten op -> rule(device, bound arguments, meta output) -> the output in the device's layout.
LAYOUTS = {
    aten.convolution.default: _convolution,
    aten.convolution_backward.default: _convolution_backward,
    aten.clone.default: _cpu_group_norm_backward_copy,
    aten.native_batch_norm.default: _cpu_batch_norm,
    aten.native_group_norm.default: _cpu_keeps("input"),
    aten.native_group_norm_backward.default: _cpu_keeps("input"),
    aten.pixel_shuffle.default: _cpu_keeps("self"),
    aten.pixel_unshuffle.default: _cpu_keeps("self"),
    **{getattr(aten, f"{kind}_pad{d}d{backward}").default: _cpu_keeps("self")
       for kind in ("reflection", "replication") for d in (1, 2, 3) for backward in ("", "_backward")},
}


class TargetLayouts(TorchDispatchMode):
    """Give the outputs of the ops in :data:`LAYOUTS`, on meta tensors, ``device``'s layout (see the module
    docstring)."""

    def __init__(self, device):
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rule = LAYOUTS.get(func)
        if rule is None or not all(t.is_meta for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
            return out
        return rule(self.device, _bound(func, args, kwargs), out)
