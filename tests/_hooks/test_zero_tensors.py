"""Pins for mixedad._hooks.zero_tensors: on a device, the primitives a dispatch mode sees run on meta tensors
(inside PyTorch's zero-tensor kernels), and the ops G calls reach the mode as aten ops."""
import torch
from torch.autograd import forward_ad as fwAD

from mixedad._hooks.dispatch_modes import TorchDispatchMode
from mixedad._hooks.pytree import tree_leaves
from mixedad._hooks.zero_tensors import inside_meta_kernel


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, [t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)]))
        return out


def test_a_zero_tangent_s_kernels_show_the_mode_primitives_on_meta_only():
    x, w, t = torch.randn(3, 4), torch.randn(4), torch.randn(3, 4)
    seen = _Seen()
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, t)
        with seen:
            out = dual * w + w  # w carries no tangent: forward AD multiplies and adds zero tensors
        assert fwAD.unpack_dual(out).tangent is not None
    primitives = [devices for func, devices in seen.ops if inside_meta_kernel(func)]
    assert primitives and all(d == "meta" for devices in primitives for d in devices), seen.ops
    assert all(func.namespace == "aten" for func, _ in seen.ops if not inside_meta_kernel(func))
