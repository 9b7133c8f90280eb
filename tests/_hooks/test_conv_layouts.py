"""Pins for mixedad._hooks.conv_layouts: ATen's own choice of a convolution's output layout, asked of fake CPU
tensors; Python's suggest_memory_format as Tensor.suggest_memory_format; meta's convolution contiguous."""
import pytest
import torch
import torch.nn.functional as F

from mixedad._hooks.conv_layouts import conv_memory_format, in_memory_format, suggest_memory_format


def _channels_last_view(n, c, h, w, dtype=torch.float32):
    """Tokens first, as diffusers' attention returns them: a channels-last view."""
    return torch.randn(n, h * w, c, dtype=dtype).transpose(1, 2).reshape(n, c, h, w)


CASES = {  # name -> (input, weight, transposed, stride, padding, groups)
    "channels-last input": (lambda d: _channels_last_view(2, 8, 6, 6, d), (4, 8, 3, 3), False, 1, 1, 1),
    "contiguous input": (lambda d: torch.randn(2, 8, 6, 6, dtype=d), (4, 8, 3, 3), False, 1, 1, 1),
    "grouped": (lambda d: _channels_last_view(2, 8, 6, 6, d), (4, 2, 3, 3), False, 1, 1, 4),
    "transposed": (lambda d: _channels_last_view(2, 8, 6, 6, d), (8, 4, 4, 4), True, 2, 1, 1),
    "1-d": (lambda d: torch.randn(2, 12, 8, dtype=d).transpose(1, 2), (4, 8, 3), False, 1, 1, 1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_cpu_answer_is_the_layout_the_cpu_convolution_gives(name, dtype):
    make, weight_shape, transposed, stride, padding, groups = CASES[name]
    x, w = make(dtype), torch.randn(weight_shape, dtype=dtype)
    dims = w.dim() - 2
    fn = F.conv_transpose2d if transposed else {1: F.conv1d, 2: F.conv2d}[dims]
    out = fn(x, w, stride=stride, padding=padding, groups=groups)
    fmt = conv_memory_format("cpu", x.to("meta"), w.to("meta"), None, [stride] * dims, [padding] * dims, [1] * dims,
                             transposed, [0] * dims, groups)
    laid = in_memory_format(torch.empty(out.shape, device="meta", dtype=dtype), fmt)
    assert laid.stride() == out.stride()


def test_meta_convolutions_are_contiguous():
    """The reason for the hook: if this fails, PyTorch's meta kernel took the device's layout itself."""
    x = _channels_last_view(2, 8, 6, 6).to("meta")
    assert F.conv2d(x, torch.randn(4, 8, 3, 3, device="meta")).is_contiguous()


@pytest.mark.parametrize("shape", [(2, 8, 6, 4), (1, 8, 1, 1), (2, 8, 1, 5), (1, 8, 3, 1)])
@pytest.mark.parametrize("strides_of", [
    lambda t: t, lambda t: t.contiguous(memory_format=torch.channels_last), lambda t: t.transpose(2, 3),
    lambda t: t.contiguous(memory_format=torch.channels_last)[..., ::2, :], lambda t: t[..., ::2, :],
    lambda t: t.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)[:, :, :, ::2]])
def test_python_suggests_the_memory_format_the_tensor_does(shape, strides_of):
    t = strides_of(torch.randn(shape))
    cpp = F.pixel_shuffle(t, 2)  # the CPU kernel lays out its output as t.suggest_memory_format()
    expected = torch.channels_last if cpp.is_contiguous(memory_format=torch.channels_last) and not \
        cpp.is_contiguous() else torch.contiguous_format
    assert suggest_memory_format(t) == expected


def test_in_memory_format_keeps_a_tensor_already_laid_out():
    t = torch.empty(2, 3, 4, 5, device="meta", memory_format=torch.channels_last)
    assert in_memory_format(t, torch.channels_last) is t
    assert in_memory_format(t, torch.contiguous_format).is_contiguous()
    line = in_memory_format(torch.empty(2, 3, 7, device="meta"), torch.channels_last)
    assert line.shape == (2, 3, 7) and line.stride() == (21, 1, 3)
