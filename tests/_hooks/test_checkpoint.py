"""Pins for mixedad._hooks.checkpoint: a reentrant checkpoint is CheckpointFunction.apply(fn, preserve, *inputs)."""
import inspect

import torch
from torch.utils.checkpoint import checkpoint

from mixedad._hooks import checkpoint as hook
from mixedad._hooks.function_apply import original_apply, routing


def test_forward_signature():
    names = list(inspect.signature(hook.CheckpointFunction.forward).parameters)
    assert names[:3] == ["ctx", "run_function", "preserve_rng_state"]


def test_a_reentrant_checkpoint_calls_apply_with_the_function_first_and_run_directly_computes_it():
    seen = []

    class Handler:
        def custom_function(self, cls, args, kwargs):
            seen.append((cls, args))
            return original_apply(cls, *args, **kwargs)

    x = torch.randn(3, requires_grad=True)
    with routing(Handler()):
        out = checkpoint(torch.sin, x, use_reentrant=True)
    cls, args = seen[0]
    assert cls is hook.CheckpointFunction and args[0] is torch.sin
    assert torch.equal(hook.run_directly(args), out.detach()) or torch.allclose(hook.run_directly(args), out)
