"""Pins for mixedad._hooks.batch_norm: F.batch_norm is torch.native_batch_norm on the CPU, and its
backward kernel in the input is the tangent of training-mode batch norm."""
import pytest
import torch
import torch.nn.functional as F

from torch import nn
from torch.nn.utils.parametrizations import spectral_norm
from torch.overrides import TorchFunctionMode

from mixedad._hooks.batch_norm import batch_norm_kernels, batch_norm_tangent, batch_norm_with_statistics, read_in_eval

SHAPES = {"1d": (6, 3), "1d_sequence": (4, 3, 5), "2d": (4, 3, 5, 5), "3d": (2, 3, 3, 4, 4)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("affine", [True, False])
def test_f_batch_norm_is_the_native_kernel_bit_for_bit(shape, dtype, affine):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPES[shape], generator=gen, dtype=dtype) * 3 + 1
    c = x.shape[1]
    w, b = (torch.rand(c, generator=gen, dtype=dtype) + 0.5, torch.randn(c, generator=gen, dtype=dtype)) if affine \
        else (None, None)
    stats = [torch.zeros(c, dtype=dtype), torch.ones(c, dtype=dtype)]
    ours_stats = [s.clone() for s in stats]
    expected = F.batch_norm(x, *stats, w, b, True, 0.1, 1e-5)
    out, mean, invstd = batch_norm_with_statistics(x, w, b, *ours_stats, 0.1, 1e-5)
    assert batch_norm_kernels(x)
    assert torch.equal(out, expected)
    assert all(torch.equal(a, e) for a, e in zip(ours_stats, stats))  # running statistics updated alike
    var, m = torch.var_mean(x, dim=[0, *range(2, x.dim())], correction=0)
    torch.testing.assert_close(mean, m)
    torch.testing.assert_close(invstd, torch.rsqrt(var + 1e-5))


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_backward_kernel_is_the_tangent(shape, channels_last):
    if channels_last and len(SHAPES[shape]) != 4:
        pytest.skip("channels_last is a 4-d layout")
    gen = torch.Generator().manual_seed(1)
    x, t = (torch.randn(SHAPES[shape], generator=gen, dtype=torch.float64) for _ in range(2))
    if channels_last:
        x, t = x.to(memory_format=torch.channels_last), t.to(memory_format=torch.channels_last)
    w = torch.rand(x.shape[1], generator=gen, dtype=torch.float64) + 0.5
    _, mean, invstd = batch_norm_with_statistics(x, w, None, None, None, 0.1, 1e-5)
    expected = torch.func.jvp(lambda x_: F.batch_norm(x_, None, None, w, None, True, 0.1, 1e-5), (x,), (t,))[1]
    torch.testing.assert_close(batch_norm_tangent(t, x, w, mean, invstd, 1e-5), expected, rtol=1e-12, atol=1e-12)


def test_other_devices_are_not_assumed_to_take_the_kernel():
    assert batch_norm_kernels(torch.empty(2, 3, device="meta"))
    assert not batch_norm_kernels(torch.empty(2, 3).to_sparse())


class _Reads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.ids = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for a in (*args, *(kwargs or {}).values()):
            self.ids.update(id(t) for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor))
        return func(*args, **(kwargs or {}))


LAYERS = {
    "BatchNorm1d": (lambda: nn.BatchNorm1d(3), (4, 3)),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(3), (2, 3, 4, 4)),
    "BatchNorm3d": (lambda: nn.BatchNorm3d(3), (2, 3, 2, 2, 2)),
    "InstanceNorm1d": (lambda: nn.InstanceNorm1d(3, track_running_stats=True), (2, 3, 5)),
    "InstanceNorm2d": (lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), (2, 3, 4, 4)),
    "spectral norm": (lambda: spectral_norm(nn.Linear(3, 3)), (2, 3)),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_the_buffers_an_eval_forward_reads_are_those_read_in_eval_says(name):
    make, shape = LAYERS[name]
    layer = make().eval()
    buffers = {(m, n): b for m in layer.modules() for n, b in m._buffers.items() if b is not None}
    with _Reads() as reads:
        layer(torch.randn(shape))
    assert {key: id(b) in reads.ids for key, b in buffers.items()} == {key: read_in_eval(*key) for key in buffers}
