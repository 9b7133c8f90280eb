"""Watching every aten call: the base class of :mod:`mixedad.profiling`'s storage counter, and which modes run.

What this relies on in torch (pinned by ``tests/_hooks/test_dispatch_modes.py``):
``torch.utils._python_dispatch.TorchDispatchMode`` sees every aten op below autograd, with
``__torch_dispatch__(func, types, args, kwargs)``; ``_get_current_dispatch_mode_stack()`` lists the
dispatch modes active on this thread, and ``torch._C._is_torch_function_mode_enabled()`` says whether a
torch function mode is.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

__all__ = ["TorchDispatchMode", "only_observers_active"]


def only_observers_active():
    """Whether modes are active on this thread and all of them are dispatch modes that only watch (a class
    attribute ``observes_only``, as :class:`mixedad.profiling.StorageCounter`)."""
    if torch._C._is_torch_function_mode_enabled():
        return False
    stack = _get_current_dispatch_mode_stack()
    return bool(stack) and all(getattr(mode, "observes_only", False) for mode in stack)
