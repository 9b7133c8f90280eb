"""Watching every aten call: the base class of :mod:`mixedad.profiling`'s storage counter.

What this relies on in torch (pinned by ``tests/_hooks/test_dispatch.py``):
``torch.utils._python_dispatch.TorchDispatchMode`` sees every aten op below autograd, with
``__torch_dispatch__(func, types, args, kwargs)``.
"""
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TorchDispatchMode"]
