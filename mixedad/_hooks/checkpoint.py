"""Reentrant ``torch.utils.checkpoint`` blocks, which mixedad's passes run directly.

What this relies on in torch (pinned by ``tests/_hooks/test_checkpoint.py``): a reentrant
checkpoint is the custom Function ``torch.utils.checkpoint.CheckpointFunction``, called as
``CheckpointFunction.apply(run_function, preserve_rng_state, *inputs)``.
"""
from torch.utils.checkpoint import CheckpointFunction

__all__ = ["CheckpointFunction", "run_directly"]


def run_directly(args):
    """What a reentrant checkpoint computes, from its ``apply`` arguments, with no recomputation."""
    run_function, _preserve_rng_state, *inputs = args
    return run_function(*inputs)
