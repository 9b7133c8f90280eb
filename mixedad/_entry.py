"""What every public call does before its own work: torch.compile and inference mode.

- **torch.compile around a mixedad call.** Dynamo would trace into mixedad's passes (its
  torch-function modes, dual levels and replays), which it cannot compile. A public call made
  while torch.compile traces runs eagerly instead, through ``torch.compiler.disable``: the
  compiled code around it breaks its graph there, and the numbers are mixedad's eager ones.
- **Inference mode** switches autograd off entirely (forward-mode tangents included), so a
  mixed derivative computed inside it comes back as zeros, and inference tensors cannot take
  part in autograd outside it either. Public calls leave inference mode for their own work and
  use copies of inference tensors; the user's tensors are not touched. The results are
  ordinary tensors.
"""
import functools

import torch

from mixedad._trees import tree_leaves, tree_map

_eager = {}


def _is_inference(t):
    return isinstance(t, torch.Tensor) and t.is_inference()


def _compiling():
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling()


def public_call(fn):
    """Decorate a public call: eager under torch.compile, outside inference mode, on ordinary tensors."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if _compiling():
            eager = _eager.get(fn)
            if eager is None:
                eager = _eager[fn] = torch.compiler.disable(fn, recursive=True)
            return eager(*args, **kwargs)
        if not torch.is_inference_mode_enabled() and not any(map(_is_inference, tree_leaves((args, kwargs)))):
            return fn(*args, **kwargs)
        with torch.inference_mode(False):
            args, kwargs = tree_map(lambda t: t.clone() if _is_inference(t) else t, (args, kwargs))
            return fn(*args, **kwargs)

    return call
