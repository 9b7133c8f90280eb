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
from torch.overrides import TorchFunctionMode

from mixedad._trees import tree_flatten, tree_map, tree_unflatten

#: Torch functions that set grad mode themselves: run as they are, never inside a no-graph block
#: (whose end would undo what they set).
GRAD_MODE_SETTERS = frozenset({torch._C._set_grad_enabled})


def primals(tree):
    """``tree`` with every tensor detached: dual tensors and torch.func's wrapped tensors lose
    their tangents (``detach`` is stop-gradient in forward AD and in torch.func alike)."""
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


@contextlib.contextmanager
def no_graph():
    """Grad disabled for the block and re-enabled after it; for ops called with grad enabled."""
    torch._C._set_grad_enabled(False)
    try:
        yield
    finally:
        torch._C._set_grad_enabled(True)


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
    inside G, gradient hooks) to the reason, and ``refusal(reason)`` builds the error to raise.
    Inference mode entered inside G is refused too.
    """

    def __init__(self, refuse=None, refusal=RuntimeError):
        super().__init__()
        self.refuse, self.refusal = refuse or {}, refusal
        level = torch._C._functorch.maybe_current_level()
        self.level = -1 if level is None else level  # G runs one level deeper, inside the pass's jvp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        level = torch._C._functorch.maybe_current_level()
        if level is not None and level > self.level + 1:
            return func(*args, **kwargs)  # a transform G runs inside itself (torch.func.grad in G)
        if func in GRAD_MODE_SETTERS:
            return func(*args, **kwargs)
        if func in self.refuse:
            raise self.refusal(self.refuse[func])
        if torch.is_inference_mode_enabled():
            raise self.refusal("G enters inference mode inside itself")
        if not torch.is_grad_enabled():
            return run_as_constant(func, args, kwargs)
        with no_graph():
            return func(*args, **kwargs)


@contextlib.contextmanager
def as_in_a_plain_call():
    """Grad and forward-mode AD enabled for the block, as a plain call of G has them.

    For the reverse passes that input_grad's forward runs inside its own autograd.Function,
    whose forward PyTorch runs with both switched off: G may use either inside itself.
    """
    forward_before = torch._C._is_fwd_grad_enabled()
    torch._C._set_fwd_grad_enabled(True)
    try:
        with torch.enable_grad():
            yield
    finally:
        torch._C._set_fwd_grad_enabled(forward_before)
