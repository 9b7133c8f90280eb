r"""Grad mode inside G, read from torch at every op: what G computes with grad off is a constant.

Forward-mode AD ignores grad mode (documented upstream): a tangent flows through a
``torch.no_grad()`` block inside G, while double backward treats what the block computes as a
constant. mixedad follows reverse mode by reading torch's own grad mode, at each op of its pass,
the way autograd itself does. G runs with grad enabled, as in a plain call, and then:

- an op called while ``torch.is_grad_enabled()`` is False gets the primals of its arguments,
  so its results carry no tangent. That holds however G turned grad off: ``with
  torch.no_grad()``, the ``@torch.no_grad()`` decorator, ``torch.set_grad_enabled(False)`` as a
  context or as a plain call, ``torch._C._set_grad_enabled(False)``, inference mode;
- an op called while grad is enabled (at G's top level, or inside ``torch.enable_grad()``
  nested in a no-grad region) keeps its tangents, and runs with grad disabled, so that no
  reverse graph is recorded for G's parameters or for tensors G closes over: memory stays flat.

.. math::

    \dot{\mathrm{out}} = \begin{cases} J_{\mathrm{op}}\, \dot{\mathrm{in}} &
    \text{grad enabled at the call} \\ 0 & \text{grad disabled at the call} \end{cases}

No torch class or attribute is replaced, and nothing is left behind: a region G leaves open (a
Python generator suspended inside ``with torch.no_grad():``) is the generator's business, as
in a plain call, and mixedad restores the grad mode it found when its pass ends.
"""
import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, resolve_name

from mixedad._hooks.dual_level import any_tangent
from mixedad._hooks.functorch import current_level, is_wrapped, under_differentiating_transform
from mixedad._hooks.grad_switches import GRAD_MODE_SETTERS, forward_ad_enabled, set_grad_enabled
from mixedad._hooks.pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

__all__ = ["GRAD_MODE_SETTERS", "REQUIRES_GRAD", "GRAPH_ATTRIBUTES", "primals", "no_graph", "run_as_constant", "cannot_batch", "ReadGradMode",
           "as_in_a_plain_call"]


#: ``t.requires_grad`` as G reads it: True for a tensor that carries a tangent, as in reverse mode
#: (G may branch on it: ``if h.requires_grad: h.register_hook(...)``).
REQUIRES_GRAD = torch.Tensor.requires_grad.__get__  # type: ignore[attr-defined]  # the property's getter
#: Reverse-mode graph attributes as G reads them: forward mode has no graph, so a G that branches
#: on them takes the whole-G fallback, where they are what double backward sees.
GRAPH_ATTRIBUTES = {torch.Tensor.is_leaf.__get__: "Tensor.is_leaf",  # type: ignore[attr-defined]
                    torch.Tensor.grad_fn.__get__: "Tensor.grad_fn"}  # type: ignore[union-attr]


def primals(tree):
    """``tree`` with every tensor detached: dual tensors and torch.func's wrapped tensors lose
    their tangents (``detach`` is stop-gradient in forward AD and in torch.func alike)."""
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


@contextlib.contextmanager
def no_graph():
    """Grad disabled for the block and re-enabled after it; for ops called with grad enabled."""
    set_grad_enabled(False)
    try:
        yield
    finally:
        set_grad_enabled(True)


def run_as_constant(func, args, kwargs):
    """``func`` on the primals of its arguments: what an op called with grad disabled gives.

    An op that writes into an argument and returns it (``x.mul_(2)``, ``out=``, a custom
    Function with ``ctx.mark_dirty``) returns the caller's own tensor, as it would in a plain
    call: its values change, its tangent does not (reverse mode does not see the write either).
    """
    leaves, spec = tree_flatten((args, kwargs))
    stripped = [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
    call_args, call_kwargs = tree_unflatten(stripped, spec)
    result = func(*call_args, **call_kwargs)
    owners = {id(d): t for d, t in zip(stripped, leaves) if isinstance(t, torch.Tensor)}
    if isinstance(result, torch.Tensor):
        return owners.get(id(result), result)
    if isinstance(result, (tuple, list)) and any(id(r) in owners for r in result):
        return type(result)(owners.get(id(r), r) for r in result)
    return result


class ReadGradMode(TorchFunctionMode):
    """Grad mode read at each op, for passes under torch.func transforms (where the op rules step aside).

    ``refuse`` maps torch functions that the pass cannot take there (``torch.autograd.grad``
    inside G, gradient hooks) to the reason, ``untrusted(func)`` gives the reason for an op
    whose tangent PyTorch's formula would get wrong there (or None), and ``refusal(reason)``
    builds the error to raise.
    Inference mode entered inside G is refused too.
    """

    def __init__(self, refuse=None, refusal=RuntimeError, untrusted=None, recorder=None):
        super().__init__()
        self.refuse, self.refusal, self.untrusted, self.recorder = refuse or {}, refusal, untrusted, recorder
        level = current_level()
        self.level = -1 if level is None else level  # G runs one level deeper, inside the pass's jvp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        level = current_level()
        if level is not None and level > self.level + 1:
            return func(*args, **kwargs)  # a transform G runs inside itself (torch.func.grad in G)
        if func in GRAD_MODE_SETTERS:
            return func(*args, **kwargs)
        if func == REQUIRES_GRAD and any_tangent(args):
            return True  # as in reverse mode, where what depends on z requires grad
        if func in GRAPH_ATTRIBUTES and any_tangent(args):
            raise self.refusal(f"G reads {GRAPH_ATTRIBUTES[func]} of a tensor that depends on z, which only a reverse "
                               f"pass has")
        if func in self.refuse:
            raise self.refusal(self.refuse[func])
        if self.untrusted is not None:
            reason = self.untrusted(func)
            if reason is not None:
                raise self.refusal(reason)
        reason = cannot_batch(func, args, kwargs)
        if reason is not None:
            raise self.refusal(reason)
        if not torch.is_grad_enabled():
            return run_as_constant(func, args, kwargs)
        with no_graph():
            result = func(*args, **kwargs)
        name = resolve_name(func) if self.recorder is not None else None
        if name is not None and any_tangent(result):  # (torch.func's own make_dual has no public name)
            self.recorder.add(name, "forward AD", "PyTorch's formula, in torch.func's pass")
        return result


def cannot_batch(func, args, kwargs):
    """Why an op of G cannot run inside torch.func (a batched pass), or None."""
    if torch.is_inference_mode_enabled():
        return "G enters inference mode inside itself"
    if _writes_captured(func, args, kwargs):
        return ("G writes in place into a tensor from outside torch.func's transform (a buffer: BatchNorm's running "
                "statistics in train mode, an EMA or codebook update, a counter, a cache)")
    return None


#: Functions that update their running statistics in place when training.
_RUNNING_STATS = {F.batch_norm: ("running_mean", 1, "training", 5), F.instance_norm: ("running_mean", 1, "use_input_stats", 5)}


def _writes_captured(func, args, kwargs):
    """Whether ``func`` writes a value computed from z into a tensor from outside the transform.

    torch.func refuses that (the write cannot carry the transform's batch or tangent); mixedad
    names it before torch raises, from the call's structure: an in-place method or ``out=``
    whose target is not one of the transform's tensors while an input is, or batch / instance
    norm updating running statistics from such an input.
    """
    name = getattr(func, "__name__", "")
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    # Under a differentiating transform (mixedad's jvp) every tensor made inside is the
    # transform's, so an unwrapped one was captured, and torch.func refuses any write into it.
    if not under_differentiating_transform() and not any(is_wrapped(t) for t in inputs):
        return False
    target = kwargs.get("out")
    if target is None and (name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))):
        target = args[0] if args else None
    if isinstance(target, torch.Tensor):
        return not is_wrapped(target)
    stats = _RUNNING_STATS.get(func)
    if stats is not None:
        key, position, flag, flag_position = stats
        running = kwargs.get(key, args[position] if len(args) > position else None)
        updating = kwargs.get(flag, args[flag_position] if len(args) > flag_position else func is F.instance_norm)
        return isinstance(running, torch.Tensor) and bool(updating) and not is_wrapped(running)
    return False


@contextlib.contextmanager
def as_in_a_plain_call():
    """Grad and forward-mode AD enabled for the block, as a plain call of G has them.

    For the reverse passes that input_grad's forward runs inside its own autograd.Function,
    whose forward PyTorch runs with both switched off: G may use either inside itself.
    """
    with forward_ad_enabled(), torch.enable_grad():
        yield
