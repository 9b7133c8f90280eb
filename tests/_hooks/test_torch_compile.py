"""Pins for mixedad._hooks.torch_compile: where torch.compile keeps the original (nothing is compiled here)."""
import torch
from torch import nn

from mixedad._hooks import torch_compile as hook


def test_the_original_of_a_compiled_module_and_function():
    m = nn.Linear(2, 2)
    assert hook.original_of(torch.compile(m, backend="eager")) is m

    def f(x):
        return x + 1

    assert hook.original_of(torch.compile(f, backend="eager")) is f
    assert hook.original_of(m) is None and hook.original_of(f) is None
    assert not hook.compiling()
