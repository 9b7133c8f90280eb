"""Whether CPU autocast is on, for the rules that call a kernel directly instead of the user's op.

Under autocast, PyTorch picks an op's dtype at the op the user calls (``F.linear``,
``F.scaled_dot_product_attention``), not at the kernel below it; a rule that calls a kernel
directly (oneDNN's linear, the CPU flash kernel, batch norm's own kernels) would compute in
another dtype than the user's call, so those rules step aside while it is on.

What this relies on in torch (pinned by ``tests/_hooks/test_autocast.py``):
``torch.is_autocast_enabled("cpu")`` (``torch.is_autocast_cpu_enabled()`` before torch 2.4) tells
whether CPU autocast is active in this thread.
"""
import torch

__all__ = ["cpu_autocast_on"]


def cpu_autocast_on():
    """Whether ``torch.autocast("cpu")`` is active here."""
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4
        return torch.is_autocast_cpu_enabled()
