"""Pins for mixedad._hooks.functorch: transform levels, interpreters and wrapped tensors."""
import torch

from mixedad._hooks import functorch as hook


def test_levels_and_interpreters():
    assert hook.current_level() is None and not hook.in_functorch_transform()
    seen = {}

    def body(x):
        seen["level"] = hook.current_level()
        seen["vmap"], seen["grad"] = hook.under_vmap(), hook.under_differentiating_transform()
        return x.sin()

    torch.func.vmap(body)(torch.randn(3, 2))
    assert isinstance(seen["level"], int) and seen["vmap"] and not seen["grad"]
    torch.func.jvp(body, (torch.randn(2),), (torch.randn(2),))
    assert seen["grad"] and not seen["vmap"]


def test_wrapped_tensors_are_the_transforms_own_and_captured_ones_are_not():
    captured = torch.zeros(2)
    seen = {}

    def body(x):
        seen["x"], seen["captured"], seen["made"] = hook.is_wrapped(x), hook.is_wrapped(captured), hook.is_wrapped(torch.ones(2))
        return x

    torch.func.jvp(body, (torch.randn(2),), (torch.randn(2),))
    assert seen == {"x": True, "captured": False, "made": True}
