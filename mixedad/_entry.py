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
import os
import sys
import warnings

import torch
from torch import nn

from mixedad._hooks.torch_compile import compiling, original_of
from mixedad._hooks.pytree import tree_leaves, tree_map

_eager = {}
_warned = set()


def warn_once(key, message):
    """Warn with ``message`` the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def user_stacklevel():
    """The ``stacklevel`` for a warning raised by the caller of this function that points at the user's line:
    the first frame outside mixedad and torch."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


_INTERNAL = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def _is_inference(t):
    return isinstance(t, torch.Tensor) and t.is_inference()


def public_call(fn):
    """Decorate a public call: eager under torch.compile, outside inference mode, on ordinary tensors."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if compiling():
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


def eager(G):
    """G itself, or the original eager module/function behind a ``torch.compile`` wrapper."""
    orig = original_of(G)
    if orig is None:
        return G
    warn_once(("compiled", id(orig)),
               "mixedad: G is compiled with torch.compile; mixedad runs its original eager module or "
               "function instead, because compiled graphs do not carry forward-mode tangents reliably.")
    return orig


def frozen(G):
    """G as a callable whose parameters are constants for autograd.

    For an ``nn.Module``, G runs with its parameters that require grad replaced by detached views of
    them for the call (in each module's parameter dict, as ``torch.func.functional_call`` would, at
    a fraction of its cost), and put back after it, even when it raises: autograd then neither
    records G's parameters nor keeps the activations their gradients would need, and the module's
    requires_grad flags are never touched. Other callables, and ``torch.jit.script``'ed modules,
    are returned as they are.
    """
    if not isinstance(G, nn.Module):
        return G
    if not any(p.requires_grad for p in G.parameters()):
        return G  # already frozen: nothing for autograd to record
    if isinstance(G, torch.jit.ScriptModule):
        # A scripted module keeps no parameter dict to swap: it runs as it is. torch.autograd.grad
        # still writes no .grad; only the graph through its parameters is kept as well.
        return G

    def call(*args):
        swapped = [(m._parameters, name, p) for m in G.modules() for name, p in m._parameters.items()
                   if p is not None and p.requires_grad]
        detached: dict = {}  # a parameter two modules share (tied weights) stays one tensor
        try:
            for params, name, p in swapped:
                params[name] = detached[id(p)] if id(p) in detached else detached.setdefault(id(p), p.detach())
            return G(*args)
        finally:
            for params, name, p in swapped:
                params[name] = p

    return call
