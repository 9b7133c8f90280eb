"""Pins for mixedad._hooks.backward_node: a dispatch mode sees which backward formula calls an op, and group norm's
first-order formula copies a channels-last gradient and input to contiguous ones on meta."""
import torch

from mixedad._hooks.backward_node import running_backward
from mixedad._hooks.dispatch_modes import TorchDispatchMode


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, (kwargs or {}).get("memory_format"), running_backward()))
        return func(*args, **(kwargs or {}))


def test_group_norm_s_backward_copies_channels_last_tensors_to_contiguous_on_meta():
    x = torch.empty_strided((2, 16, 8, 8), (1024, 1, 128, 16), device="meta").requires_grad_()
    out = torch.native_group_norm(x, None, None, 2, 16, 64, 4, 1e-5)[0]
    grad = torch.empty_like(out)
    assert running_backward() is None
    with _Seen() as seen:
        torch.autograd.grad(out, x, grad)
    clones = [op for op in seen.ops if op[0] is torch.ops.aten.clone.default]
    assert clones == [(torch.ops.aten.clone.default, torch.contiguous_format, "NativeGroupNormBackward0")] * 2
