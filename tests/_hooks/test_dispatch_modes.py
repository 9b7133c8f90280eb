"""Pins for mixedad._hooks.dispatch_modes: a TorchDispatchMode sees aten ops below autograd."""
import torch

from mixedad._hooks.dispatch_modes import TorchDispatchMode


def test_a_dispatch_mode_sees_aten_ops():
    seen = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(2).sin()
    assert torch.ops.aten.sin.default in seen


def test_only_observers_active_tells_watching_modes_from_others():
    from mixedad._hooks.dispatch_modes import only_observers_active
    from mixedad.profiling import StorageCounter

    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert not only_observers_active()  # no mode at all
    with StorageCounter():
        assert only_observers_active()
        with Other():
            assert not only_observers_active()
    with Other():
        assert not only_observers_active()
    with torch.overrides.TorchFunctionMode(), StorageCounter():
        assert not only_observers_active()
