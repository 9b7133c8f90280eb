r"""The target device's kernel choices, emulated on meta tensors.

On meta, ``F.scaled_dot_product_attention`` takes PyTorch's math backend, which holds the
:math:`T \times T` scores; CUDA (and the CPU) take a fused kernel that holds only the output and
a float32 log-sum-exp per query:

.. math::

    \mathrm{bytes} = \mathrm{bytes}(O) + 4\cdot B H L

:class:`TargetDevice` gives a fused call exactly those allocations where the device would take a
fused kernel: no input needs a graph (a plain forward, mixedad's primal), no dropout, and the
fused backends are enabled (the reference's double backward switches them off and takes the math
backend on a GPU too). What is not emulated, and so planned as the composite path: the
``nn.TransformerEncoderLayer`` / ``nn.MultiheadAttention`` fast path and device-specific output
layouts (GroupNorm on channels_last). Fused RNNs (``nn.LSTM`` / ``GRU`` / ``RNN``) are refused:
their memory is that of the device's kernel (cuDNN's reserve space, oneDNN's workspace), which a
run on meta does not see; measured against the CPU, it held 0.1x to 0.3x of the real peak, a
plan that would say "fits" where the card overflows.
"""
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mixedad._hooks.attention_backends import fused_attention_enabled, planning_for
from mixedad._planner.meta import PlanError
from mixedad.op_rules._rnn import FUSED_RNNS

__all__ = ["TargetDevice", "DEVICES", "planning_for"]

#: The devices a plan can target.
DEVICES = ("cuda", "cpu")

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class TargetDevice(TorchFunctionMode):
    """Emulate ``device``'s fused attention on meta tensors (see the module docstring)."""

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
        if func is F.scaled_dot_product_attention:
            bound = dict(zip(_SDPA_ARGS, args), **kwargs)
            q, v = bound["query"], bound["value"]
            fused = (isinstance(q, torch.Tensor) and q.is_meta and bound.get("dropout_p", 0.0) == 0.0
                     and not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                              for t in (q, bound["key"], v)))
                     and fused_attention_enabled())
            if fused:
                out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device="meta")
                torch.empty(q.shape[:-1], dtype=torch.float32, device="meta")  # the log-sum-exp, freed at once
                return out
        return func(*args, **kwargs)
