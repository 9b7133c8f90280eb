"""Pins for mixedad._hooks.module_hooks: where backward hooks live, and the Function full hooks run through."""
import torch
from torch import nn

from mixedad._hooks import module_hooks as hook
from mixedad._hooks.function_apply import original_apply, routing


def test_hooks_are_found_on_the_module_and_globally():
    m = nn.Linear(2, 2)
    assert not hook.backward_hooks([m])
    handle = m.register_full_backward_hook(lambda *a: None)
    assert hook.backward_hooks([m])
    handle.remove()
    handle = nn.modules.module.register_module_full_backward_pre_hook(lambda *a: None)
    try:
        assert hook.backward_hooks([m])
    finally:
        handle.remove()
    assert not hook.backward_hooks([m])


def test_full_backward_hooks_run_through_backward_hook_function():
    seen = []

    class Handler:
        def custom_function(self, cls, args, kwargs):
            seen.append(cls)
            return original_apply(cls, *args, **kwargs)

    m = nn.Linear(2, 2)
    m.register_full_backward_hook(lambda *a: None)
    with routing(Handler()):
        m(torch.randn(1, 2, requires_grad=True))
    assert hook.BackwardHookFunction in seen
