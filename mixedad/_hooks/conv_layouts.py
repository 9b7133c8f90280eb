"""The memory layout a device's kernels give an output, for meta tensors, which have no device to ask.

Meta's kernels leave some outputs contiguous where the device's kernels keep the input's layout:
a convolution of a channels-last input (diffusers' attention returns one) is channels-last on the
CPU and with cuDNN, and contiguous on meta; a plan that follows meta misses every copy and layout
change downstream. This module answers, for one op, the layout the device would give.

What this relies on in torch (pinned by ``tests/_hooks/test_conv_layouts.py``):

- ``torch._C._select_conv_backend(input, weight, bias, stride, padding, dilation, transposed,
  output_padding, groups, bias_sizes)`` returns the backend ATen's convolution takes for tensors of
  ``input``'s device, and ``torch._C._conv_determine_backend_memory_format(input, weight, backend)``
  the memory format that backend gives the output (and ``convolution_backward`` its ``grad_input``
  and ``grad_weight``); a 1-d convolution is asked as a 2-d one of a contiguous input. Both read
  the sizes, strides, dtype, requires_grad and device of tensors made by ``torch.empty_strided``
  under a ``FakeTensorMode`` (no memory), never data. PyTorch's own fake tensors take their
  convolutions' layouts the same way (``torch/_subclasses/fake_impls.py``, ``conv``).
- A CPU build cannot answer for cuDNN, whose rule (``cudnn_conv_suggest_memory_format`` in
  ``ATen/native/ConvUtils.h``) is written out here: channels-last (``channels_last_3d`` for 3-d)
  where the input or the weight suggests it, except in float64; CUDA convolutions that do not take
  cuDNN (``torch.backends.cudnn.enabled = False``) give contiguous outputs.
- ``torch._prims_common.suggest_memory_format`` answers as ``Tensor.suggest_memory_format`` does.
"""
import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["conv_memory_format", "in_memory_format", "suggest_memory_format"]

_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def _fake_cpu(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu").requires_grad_(t.requires_grad)


def _cpu_conv_memory_format(input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups):
    with FakeTensorMode():
        fake_input, fake_weight = _fake_cpu(input), _fake_cpu(weight)
        backend = torch._C._select_conv_backend(fake_input, fake_weight, None, stride, padding, dilation, transposed,
                                                output_padding, groups, bias_sizes)
        if weight.dim() == 3:  # asked as the 2-d convolution ATen runs
            fake_input, fake_weight = fake_input.contiguous().unsqueeze(2), fake_weight.unsqueeze(2)
        return torch._C._conv_determine_backend_memory_format(fake_input, fake_weight, backend)


def _cudnn_memory_format(input, weight):
    if not torch.backends.cudnn.enabled or torch.float64 in (input.dtype, weight.dtype):
        return torch.contiguous_format
    if weight.dim() == 3:  # asked as the 2-d convolution ATen runs, of a contiguous input
        input = torch.empty(input.shape, dtype=input.dtype, device="meta").unsqueeze(2)
        weight = weight.unsqueeze(2)
    wanted = _CHANNELS_LAST.get(weight.dim())
    if wanted is not None and wanted in (suggest_memory_format(input), suggest_memory_format(weight)):
        return wanted
    return torch.contiguous_format


def conv_memory_format(device, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
                       groups):
    """The memory format ``device``'s convolution gives its output, grad_input and grad_weight ("cpu" or "cuda")."""
    if device == "cuda":
        return _cudnn_memory_format(input, weight)
    return _cpu_conv_memory_format(input, weight, bias_sizes, stride, padding, dilation, transposed,
                                   output_padding, groups)


def in_memory_format(t, memory_format):
    """A meta tensor of ``t``'s size and dtype in ``memory_format`` (``t`` itself where it already is); a 3-d tensor
    in ``channels_last`` as the 2-d kernel leaves it (its middle dimension of size 1 dropped)."""
    if memory_format == torch.contiguous_format and t.is_contiguous():
        return t
    if t.dim() == 3 and memory_format == torch.channels_last:
        laid = torch.empty(t.unsqueeze(2).shape, dtype=t.dtype, device=t.device, memory_format=memory_format).squeeze(2)
    else:
        laid = torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=memory_format)
    return t if laid.stride() == t.stride() else laid.requires_grad_(t.requires_grad)
