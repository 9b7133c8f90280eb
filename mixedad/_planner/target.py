r"""The target device's kernel choices, emulated on meta tensors.

On meta, ``F.scaled_dot_product_attention`` takes PyTorch's math backend, which holds the
:math:`T \times T` scores; CUDA (and the CPU) take a fused kernel that holds only the output and
a float32 log-sum-exp per query:

.. math::

    \mathrm{bytes} = \mathrm{bytes}(O) + 4\cdot B H L

:class:`TargetDevice` gives a fused call exactly those allocations where the device would take a
fused kernel: no dropout, the fused backends enabled, and sizes, strides and dtypes a fused kernel
takes (:func:`~mixedad._hooks.attention_backends.fused_kernel_would_run`; elsewhere the math
backend, as the device would run it) (the reference's double backward switches them off and takes the math
backend on a GPU too). With a graph (``input_grad``'s forward), the fused call saves its inputs,
output and log-sum-exp, and its backward allocates one gradient per input. The output takes the
device's layout (the CPU's flash kernel: the query's; CUDA: tokens before heads), and a bool mask
is converted to an additive one for the call. An additive mask under a graph is planned on the
math backend, which ``input_grad``'s forward takes where a row is masked only by large finite
numbers (HF's ``finfo.min`` padding): meta has no values to tell, so such a plan is high by the
scores where the CPU or GPU would take the fused kernel, never low. A mask G closes over (a plain
attribute, which ``functional_call`` does not make meta) has values: it stands as a meta tensor of
its shape, and that choice is exact. Grouped query heads take the fused kernel where
:func:`~mixedad._hooks.attention_backends.fused_kernel_would_run` says the device does. ``F.group_norm`` on a CPU plan
runs as the CPU's composite runs it, in its input's layout (meta's and CUDA's copy a channels-last input to a
contiguous one); the layouts of other ops' outputs are :mod:`mixedad._planner.layouts`'. What is not emulated, and
so planned as the composite path: the ``nn.TransformerEncoderLayer`` / ``nn.MultiheadAttention`` fast path. Fused
RNNs (``nn.LSTM`` / ``GRU`` / ``RNN``) are refused:
their memory is that of the device's kernel (cuDNN's reserve space, oneDNN's workspace), which a
run on meta does not see: a plan of them would say "fits" where the card overflows
(docs/performance.md, "Measurements behind the design").
"""
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mixedad._hooks.attention_backends import (fused_attention_enabled, fused_kernel_would_run, meta_stand_in,
                                                planning_for)
from mixedad._hooks.composites import COMPOSITES, run_inside
from mixedad._hooks.conv_layouts import suggest_memory_format
from mixedad._planner.meta import PlanError
from mixedad.op_rules._rnn import FUSED_RNNS

__all__ = ["TargetDevice", "DEVICES", "planning_for"]

#: The devices a plan can target.
DEVICES = ("cuda", "cpu")

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class TargetDevice(TorchFunctionMode):
    """Emulate ``device``'s fused attention (and the CPU's group norm) on meta tensors (see the module docstring)."""

    def __init__(self, device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FUSED_RNNS and any(isinstance(t, torch.Tensor) and t.is_meta for t in args[:1]):
            raise PlanError(
                f"plan: {func.__name__} (nn.LSTM / GRU / RNN) cannot be planned on meta tensors: its memory is that of "
                f"the {self.device} kernel (cuDNN's reserve space, oneDNN's workspace), which meta does not emulate, "
                f"and a plan would read far too low. Measure it on the device with mixedad.profiling.peak_memory.")
        if func in COMPOSITES:  # nn.MultiheadAttention's Python body: its inner SDPA is emulated too
            return run_inside(self, func, args, kwargs)
        if func in (F.group_norm, torch.group_norm) and self.device == "cpu" and _meta_input(args, kwargs):
            return _cpu_group_norm(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            bound = dict(zip(_SDPA_ARGS, args), **kwargs)
            q, k, v, mask = bound["query"], bound["key"], bound["value"], bound.get("attn_mask")
            # A mask G closes over is real: it stands as its shape on the device, and its values were read where
            # they choose the kernel (input_grad's forward: math where a row is masked by large numbers only).
            read = isinstance(q, torch.Tensor) and q.is_meta and isinstance(mask, torch.Tensor) and not mask.is_meta
            if read:
                mask = bound["attn_mask"] = meta_stand_in(mask)
                args, kwargs = (), bound
            if (isinstance(q, torch.Tensor) and q.is_meta and bound.get("dropout_p", 0.0) == 0.0
                    and fused_attention_enabled()
                    and fused_kernel_would_run(q, k, v, mask, self.device, bool(bound.get("enable_gqa", False)))):
                inputs = (q, k, v) if mask is None else (q, k, v, mask)
                if not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                        for t in inputs)):
                    return _fused_outputs(q, v, mask, self.device)[0]  # the converted mask and lse freed at once
                if mask is None or read or (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool):
                    return _FusedAttention.apply(q, k, v, mask, self.device)  # input_grad's forward: a graph
                # An additive mask on meta under a graph: input_grad's forward takes the math backend where some row
                # is masked only by large finite numbers, which meta cannot tell; planned so (high, never low).
        return func(*args, **kwargs)


def _meta_input(args, kwargs):
    x = args[0] if args else kwargs.get("input")
    return isinstance(x, torch.Tensor) and x.is_meta


def _cpu_group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    """``torch.group_norm`` as its CPU composite runs it: the input in its own suggested memory format (meta's and
    CUDA's composite copy it to a contiguous one), then ``native_group_norm`` (whose output
    :mod:`mixedad._planner.layouts` lays out as the CPU kernel does)."""
    x = input.contiguous(memory_format=suggest_memory_format(input))
    gamma, beta = (None if t is None else t.contiguous() for t in (weight, bias))
    return torch.native_group_norm(x, gamma, beta, input.shape[0], input.shape[1], math.prod(input.shape[2:]),
                                   num_groups, eps)[0]


def _fused_outputs(q, v, mask, device):
    """What a fused SDPA kernel allocates: ``(output, log-sum-exp, the mask it reads)``.

    A bool mask is converted to an additive one of the query's dtype (a graph keeps it for the
    backward).
    The CPU's flash kernel gives its output the query's memory layout; CUDA's kernels work on
    (batch, tokens, heads, features) and return a view of that.
    """
    converted = torch.empty(mask.shape, dtype=q.dtype, device="meta") if (
        isinstance(mask, torch.Tensor) and mask.dtype == torch.bool) else mask
    shape = (*q.shape[:-1], v.shape[-1])
    if device == "cuda" and q.dim() == 4:
        out = torch.empty(shape[0], shape[2], shape[1], shape[3], dtype=q.dtype, device="meta").transpose(1, 2)
    else:
        order = sorted(range(q.dim()), key=lambda d: -q.stride(d))  # q's dims from outermost to innermost
        out = torch.empty([shape[d] for d in order], dtype=q.dtype, device="meta").permute(
            [order.index(d) for d in range(q.dim())])
    lse = torch.empty(q.shape[:-1], dtype=torch.float64 if q.dtype == torch.float64 and device == "cpu"
                      else torch.float32, device="meta")
    return out, lse, converted


class _FusedAttention(torch.autograd.Function):
    """A fused SDPA on meta with a graph: saves the inputs, the output and the log-sum-exp; its
    backward allocates one gradient per input (the math backend would save T x T scores)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, device):
        out, lse, converted = _fused_outputs(q, v, mask, device)
        ctx.save_for_backward(q, k, v, out, lse, converted)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None
