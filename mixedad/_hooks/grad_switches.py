"""Grad mode as torch's C++ core holds it, which mixedad reads and sets at every op.

What this relies on in torch (pinned by ``tests/_hooks/test_grad_switches.py``):

- every Python way of switching grad mode (``torch.no_grad``, ``enable_grad``,
  ``set_grad_enabled``, as a decorator or a context) ends in ``torch._C._set_grad_enabled``, a
  torch function that a ``TorchFunctionMode`` sees; so a mode can let those calls through and
  read ``torch.is_grad_enabled()`` at each later op;
- ``torch._C._set_fwd_grad_enabled`` / ``_is_fwd_grad_enabled`` switch forward-mode AD, which a
  custom Function's forward runs with switched off.
"""
import contextlib

import torch

#: The torch functions that switch grad mode; a mode lets them through untouched.
GRAD_MODE_SETTERS = frozenset({torch._C._set_grad_enabled})


def set_grad_enabled(enabled):
    """Switch grad mode without a torch-function call (inside a mode's dispatch)."""
    torch._C._set_grad_enabled(enabled)


@contextlib.contextmanager
def forward_ad_enabled():
    """Forward-mode AD switched on for the block, and back as it was afterwards."""
    before = torch._C._is_fwd_grad_enabled()
    torch._C._set_fwd_grad_enabled(True)
    try:
        yield
    finally:
        torch._C._set_fwd_grad_enabled(before)
