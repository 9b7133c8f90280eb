"""Pins for mixedad._hooks.dispatch: a TorchDispatchMode sees aten ops below autograd."""
import torch

from mixedad._hooks.dispatch import TorchDispatchMode


def test_a_dispatch_mode_sees_aten_ops():
    seen = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(2).sin()
    assert torch.ops.aten.sin.default in seen
