"""Which child of an ``nn.Sequential`` is running, for folding eval BatchNorm into the convolution before it.

Inside an ``nn.Sequential`` a convolution's output goes to the next child and nowhere else, so
the tangent of ``conv -> eval BatchNorm`` is one convolution with the weight scaled per output
channel (mixedad's frozen-layer rules, :mod:`mixedad.op_rules._frozen_layers`).

What this relies on in torch (pinned by ``tests/_hooks/test_sequential.py``):

- ``nn.Sequential.forward`` calls its children in order, as ``input = module(input)``, with the
  running child in a local named ``module``;
- ``frame.f_locals`` is, before Python 3.13, a dict snapshot that the frame keeps (and refreshes
  on each access), so it is cleared after reading: it would keep the Sequential's ``input`` alive;
- a module without forward hooks returns its ``forward``'s value unchanged, and the forward of
  ``nn.Conv{1,2,3}d`` / ``nn.ConvTranspose{1,2,3}d`` returns the value of its ``F.conv*`` call;
- forward hooks live in ``module._forward_hooks`` and ``_forward_pre_hooks``, the global ones in
  ``torch.nn.modules.module._global_forward_hooks`` and ``_global_forward_pre_hooks``.
"""
import sys

from torch import nn
from torch.nn.modules import module as _module_globals

__all__ = ["running_child", "forward_hooks"]

_SEQUENTIAL_FORWARD = nn.Sequential.forward.__code__
#: How many frames up from the caller to look for nn.Sequential.forward (a rule sits about ten below it).
FRAMES = 24


def running_child():
    """``(sequential, child)`` of the innermost ``nn.Sequential.forward`` on this thread's stack, or None."""
    frame = sys._getframe(1)
    for _ in range(FRAMES):
        if frame is None:
            return None
        if frame.f_code is _SEQUENTIAL_FORWARD:
            local = frame.f_locals
            try:
                return local.get("self"), local.get("module")
            finally:
                if type(local) is dict:
                    # Python < 3.13 keeps this snapshot of the locals on the frame: it would hold the
                    # Sequential's current input (primal and tangent) alive after the loop moves on.
                    local.clear()
        frame = frame.f_back
    return None


def forward_hooks(*modules):
    """Whether any of ``modules``, or every module (global hooks), has forward hooks or forward pre-hooks."""
    if _module_globals._global_forward_hooks or _module_globals._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)
