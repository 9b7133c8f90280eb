"""The target device's output layouts on meta: every op of the table, forward and backward, laid out as the CPU
lays it out, with the same live bytes; CUDA's convolutions as cuDNN lays them out."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from mixedad._planner.layouts import TargetLayouts
from mixedad._planner.target import TargetDevice
from mixedad.profiling import StorageCounter

C = 16


def _weight(x, *shape):
    return torch.randn(shape, dtype=x.dtype, generator=torch.Generator().manual_seed(0)).to(x.device)


OPS = {
    "conv": lambda x: F.conv2d(x, _weight(x, 8, C, 3, 3), padding=1),
    "conv 1x1 with bias": lambda x: F.conv2d(x, _weight(x, 8, C, 1, 1), _weight(x, 8)),
    "conv grouped": lambda x: F.conv2d(x, _weight(x, 8, C // 4, 3, 3), padding=1, groups=4),
    "conv dilated, strided": lambda x: F.conv2d(x, _weight(x, 8, C, 3, 3), padding=2, dilation=2, stride=2),
    "conv transposed": lambda x: F.conv_transpose2d(x, _weight(x, C, 8, 4, 4), stride=2, padding=1),
    "conv 1-d": lambda x: F.conv1d(x.flatten(2), _weight(x, 8, C, 3), padding=1),
    "conv 3-d": lambda x: F.conv3d(x.unsqueeze(2), _weight(x, 8, C, 1, 3, 3), padding=(0, 1, 1)),
    "group norm": lambda x: F.group_norm(x, 4, _weight(x, C)),
    "pixel shuffle": lambda x: F.pixel_shuffle(x, 2),
    "pixel unshuffle": lambda x: F.pixel_unshuffle(x, 2),
    "reflection pad": lambda x: F.pad(x, (1, 1, 1, 1), mode="reflect"),
    "replication pad": lambda x: F.pad(x, (1, 2, 1, 2), mode="replicate"),
    "batch norm": lambda x: F.batch_norm(x, None, None, training=True),
    "batch norm, eval": lambda x: F.batch_norm(x, _weight(x, C), _weight(x, C).abs(), _weight(x, C)),
    "upsample": lambda x: F.interpolate(x, scale_factor=2.0, mode="bilinear"),
}
LAYOUTS = {
    "contiguous": lambda: torch.randn(2, C, 8, 8),
    "channels-last": lambda: torch.randn(2, C, 8, 8).contiguous(memory_format=torch.channels_last),
    "tokens first (attention's output)": lambda: torch.randn(2, 64, C).transpose(1, 2).reshape(2, C, 8, 8),
}


def _run(fn, x, meta):
    x = (torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") if meta else x).requires_grad_()
    emulated = contextlib.ExitStack()
    if meta:
        emulated.enter_context(TargetDevice("cpu"))
        emulated.enter_context(TargetLayouts("cpu"))
    with emulated, StorageCounter(meta=meta) as counter:
        out = fn(x)
        (grad,) = torch.autograd.grad(out, x, torch.empty_like(out) if meta else torch.ones_like(out))
    return counter.peak, out.stride(), grad.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("op", sorted(OPS))
def test_meta_lays_out_as_the_cpu_does_with_the_same_live_bytes(op, layout, dtype):
    x = LAYOUTS[layout]().to(dtype)
    (cpu, cpu_out, cpu_grad), (meta, meta_out, meta_grad) = _run(OPS[op], x, False), _run(OPS[op], x, True)
    assert meta_out == cpu_out and meta_grad == cpu_grad and meta == cpu


def _conv_on_meta(x, w, **kwargs):
    with TargetLayouts("cuda"):
        return F.conv2d(x, w, **kwargs) if w.dim() == 4 else F.conv3d(x, w, **kwargs)


def _meta(shape, dtype=torch.float16, memory_format=torch.contiguous_format):
    return torch.empty(shape, dtype=dtype, device="meta", memory_format=memory_format)


CL, CL3 = torch.channels_last, torch.channels_last_3d
CUDNN = {  # name -> (input, weight, the memory format cuDNN gives the output: ATen/native/ConvUtils.h)
    "contiguous": (lambda: _meta((2, 8, 6, 6)), lambda: _meta((4, 8, 3, 3)), torch.contiguous_format),
    "channels-last input": (lambda: _meta((2, 8, 6, 6), memory_format=CL), lambda: _meta((4, 8, 3, 3)), CL),
    "channels-last weight": (lambda: _meta((2, 8, 6, 6)), lambda: _meta((4, 8, 3, 3), memory_format=CL), CL),
    "float64": (lambda: _meta((2, 8, 6, 6), torch.float64, CL), lambda: _meta((4, 8, 3, 3), torch.float64),
                torch.contiguous_format),
    "3-d": (lambda: _meta((2, 8, 3, 6, 6), memory_format=CL3), lambda: _meta((4, 8, 1, 3, 3)), CL3),
}


@pytest.mark.parametrize("name", sorted(CUDNN))
def test_cuda_convolutions_take_cudnns_layout(name):
    x, w, expected = CUDNN[name]
    out = _conv_on_meta(x(), w(), padding=1)
    assert out.is_contiguous(memory_format=expected)
    with torch.backends.cudnn.flags(enabled=False):  # PyTorch's own CUDA kernels: contiguous
        assert _conv_on_meta(x(), w(), padding=1).is_contiguous()
