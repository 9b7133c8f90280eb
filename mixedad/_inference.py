"""Calls made under ``torch.inference_mode()``, or with tensors created there.

Inference mode switches autograd off entirely (forward-mode tangents included), so a mixed
derivative computed inside it comes back as zeros, and inference tensors cannot take part in
autograd outside it either. mixedad's public calls leave inference mode for their own work and
use copies of inference tensors; the user's tensors are not touched. The results are ordinary
tensors.
"""
import functools

import torch

from mixedad._trees import tree_leaves, tree_map


def _is_inference(t):
    return isinstance(t, torch.Tensor) and t.is_inference()


def outside_inference_mode(fn):
    """Decorate a public call so that it runs outside inference mode, on ordinary tensors."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not torch.is_inference_mode_enabled() and not any(map(_is_inference, tree_leaves((args, kwargs)))):
            return fn(*args, **kwargs)
        with torch.inference_mode(False):
            args, kwargs = tree_map(lambda t: t.clone() if _is_inference(t) else t, (args, kwargs))
            return fn(*args, **kwargs)

    return call
