"""Pins for mixedad._hooks.torch_function_stack: the innermost mode is read and popped for a block."""
import torch
from torch.overrides import TorchFunctionMode

from mixedad._hooks.torch_function_stack import popped


class Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_popped_takes_the_innermost_mode_off_for_the_block_only():
    mode = Count()
    with mode:
        with popped(mode):
            torch.ones(1).sin()
        assert mode.calls == 0
        torch.ones(1).sin()
        assert mode.calls >= 1
    other = Count()
    with mode, other:
        with popped(mode):  # not the innermost: nothing is popped
            torch.ones(1).sin()
    assert other.calls >= 1
