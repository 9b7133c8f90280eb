"""The stack of torch-function modes, which a rule steps out of to run an op plainly.

What this relies on in torch (pinned by ``tests/_hooks/test_torch_function_stack.py``):
``torch._C._len_torch_function_stack()`` and ``torch._C._get_function_stack_at(i)`` read the
thread's stack of ``TorchFunctionMode``\\ s (innermost last), and
``torch.overrides._pop_mode_temporarily()`` takes the innermost one off for a block, and
``torch._C.DisableTorchFunction()`` turns every mode (and subclasses' ``__torch_function__``) off
for a block, modes pushed inside it included.
"""
import contextlib

import torch
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily


def unseen():
    """No torch-function mode sees the ops of the block (nor does a subclass's ``__torch_function__`` run): mixedad's
    own bookkeeping inside a pass (copies of buffers, versions), which the pass's modes would take for G's ops."""
    return torch._C.DisableTorchFunction()


def innermost(mode):
    """Whether ``mode`` is the innermost torch function mode of this thread."""
    depth = torch._C._len_torch_function_stack()
    return bool(depth) and torch._C._get_function_stack_at(depth - 1) is mode


@contextlib.contextmanager
def popped(mode):
    """``mode`` off for the block, when it is the innermost torch function mode."""
    if innermost(mode):
        with _pop_mode_temporarily():
            yield
    else:
        yield


class Calls(TorchFunctionMode):
    """Records, in order, every torch function called while it is active (to learn which function an operator
    reaches the torch-function layer as)."""

    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))
