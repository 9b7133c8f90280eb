"""What every forward pass of mixedad stands in: its turn at PyTorch's one forward-AD level, and the set-up around it.

PyTorch keeps one forward-AD level for the whole process (``forward_ad._current_level``), so two
threads in forward mode at once would see each other's level. mixedad's forward passes take turns
for the block that holds the level (:data:`FORWARD_PASS_LOCK`), and only for it: the whole-G
fallback and the passes under torch.func transforms run at once in other threads. Tracing G for a
tangent program and the zoo's calibration take the same turn.
"""
import contextlib
import threading

import torch

from mixedad._ground import watch
from mixedad._ground.errors import NeedsWholeG
from mixedad._hooks.attention_backends import differentiable_attention
from mixedad._hooks.dual_level import dual_level_open

__all__ = ["FORWARD_PASS_LOCK", "forward_pass"]

#: The turn at the forward-AD level (reentrant: a rule's own pass runs inside its caller's).
FORWARD_PASS_LOCK = threading.RLock()


@contextlib.contextmanager
def forward_pass(rules):
    """What every forward pass of mixedad runs in: its turn at PyTorch's one forward-AD level,
    grad enabled, attention on a differentiable backend where the attention rule is off, and the
    generators G's ops receive noted by the dispatch itself (the watch of :mod:`mixedad._ground.watch` off).

    Raises NeedsWholeG inside the caller's own ``forward_ad.dual_level()``.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(FORWARD_PASS_LOCK)
        stack.enter_context(watch.off())
        if dual_level_open():
            # PyTorch has one forward-AD level: inside the caller's own dual_level() neither dual
            # tensors nor torch.func.jvp can open another.
            raise NeedsWholeG("called inside an open forward_ad.dual_level(), and PyTorch cannot nest "
                              "forward-mode AD")
        stack.enter_context(torch.enable_grad())
        # With the attention rule, SDPA keeps the user's fused kernel (and torch leaves the
        # nn.MultiheadAttention fast path while a torch-function mode is active); without it,
        # forward AD needs the math backend.
        if not rules.attention:
            stack.enter_context(differentiable_attention())
        yield
