r"""The double-VJP trick: a Jacobian-vector product from two reverse passes.

.. math::

    J v = \partial_u \big\langle J^\top u,\ v \big\rangle

:math:`u \mapsto J^\top u` is linear, so the derivative in u is J at every u; mixedad evaluates
it at u = 1 (all ones), never at u = 0, where some backward formulas are singular (PyTorch's
``logcumsumexp`` backward takes ``log|u|``). Used for a single op by the local rule
(:mod:`mixedad.op_rules._local`) and for all of G by the whole-G fallback in
:mod:`mixedad._frontend.tangents`.

Reverse mode is the meaning. Where the second pass cannot reach u, the backward of some op is
not differentiable, and double backward through it would either raise or silently lose that
path; mixedad raises :class:`OpRuleError` instead of returning a number.
"""
import torch

from mixedad._hooks.autograd_graph import compiled_region, once_differentiable_node
from mixedad._ground.errors import OpRuleError


def _subject(name):
    return "an op in G" if name == "G" else name


def _hint(outputs):
    """Advice for failures whose cause we can name from the graph."""
    if compiled_region(outputs):
        return (" A torch.compile'd submodule inside G has no double backward; mixedad unwraps a "
                "compiled G itself, but not compiled parts inside it: pass G with those parts eager "
                "(module._orig_mod), or compile after computing the derivatives.")
    return ""


def double_vjp(call, name, outputs, inputs, tangents, *, at=None, batched=False):
    r"""Tangents of ``outputs`` along ``tangents`` of ``inputs``, by two reverse passes.

    .. math::

        \dot o_j = \partial_{u_j} \sum_i \Big\langle \sum_k J_{ki}^\top u_k,\ \dot x_i \Big\rangle
        \Big|_{u = 1}

    Args:
        call: the public call's name, for messages.
        name: what the outputs come from (an op, a custom Function, "G"), for messages.
        outputs: tensors that require grad, computed from ``inputs`` with grad enabled.
        inputs: tensors that require grad (leaves of the graph that matters).
        tangents: one tangent per input.

        at: keyword-only; None (u = 1), or one tensor per output: the u to differentiate at.
            For a backward linear in u any u gives the same answer; for one that is not (a
            gradient hook, a custom Function that clips its gradient) only double backward's
            own cotangent gives its answer.
        batched: keyword-only; the tangents carry a leading dimension k (a batch of tangents).
            The first reverse pass runs once; the second once per tangent of the batch.

    Returns:
        One tensor per output: its tangent (zeros where the output does not depend on the inputs),
        with the leading dimension k when ``batched``.

    Raises:
        OpRuleError: the backward of something between inputs and outputs cannot itself be
            differentiated (``@once_differentiable``, or a backward computed outside autograd),
            or has no derivative formula.
    """
    if at is None:
        us = [torch.ones_like(o, requires_grad=True) for o in outputs]
    else:
        us = [u.detach().to(o.dtype).clone().requires_grad_() for u, o in zip(at, outputs)]
    try:
        pulled = torch.autograd.grad(outputs, inputs, grad_outputs=us, create_graph=True, allow_unused=True)
    except RuntimeError as error:
        raise OpRuleError(
            f"{call}: {_subject(name)} has no usable forward-mode formula, and its backward failed too, so "
            f"mixedad cannot push a tangent through it ({error}). Give it a forward-mode rule (a jvp "
            f"staticmethod for a custom autograd.Function)." + _hint(outputs)
        ) from error
    pairs = [(p, t) for p, t in zip(pulled, tangents) if p is not None]
    live = [(p, t) for p, t in pairs if p.requires_grad]
    for p, _ in pairs:
        if not p.requires_grad and bool(p.ne(0).any()):
            raise OpRuleError(
                f"{call}: {_subject(name)} has no forward-mode formula, and its backward is not differentiable "
                f"in its incoming gradient (it is computed outside autograd, under no_grad, or "
                f"detached), so double backward through it would silently lose this path. Give it a "
                f"forward-mode rule: for a custom autograd.Function, a jvp staticmethod."
            )
    if once_differentiable_node([p for p, _ in live]) is not None:
        who = (f"{name} has no jvp staticmethod and its backward is marked @once_differentiable" if name != "G"
               else "G contains a custom autograd.Function whose backward is marked @once_differentiable")
        raise OpRuleError(
            f"{call}: {who}, so its Jacobian-vector product can be computed neither by forward mode nor "
            f"by differentiating its backward (plain double backward raises here too). Add a jvp "
            f"staticmethod to it: jvp(ctx, *input_tangents) returning the output tangents"
            + ("." if name != "G" else ", and use strategy='auto' or 'forward'.")
        )
    results = [None] * len(outputs)
    if live:
        try:
            results = _second_pass([p for p, _ in live], us, [t for _, t in live], batched)
        except RuntimeError as error:
            raise OpRuleError(
                f"{call}: {_subject(name)} has no usable forward-mode formula, and its backward cannot be "
                f"differentiated ({error}). Give it a forward-mode rule (a jvp staticmethod for a "
                f"custom autograd.Function)." + _hint(outputs)
            ) from error
    if live and all(r is None for r in results) and any(bool(p.ne(0).any()) for p, _ in live):
        raise OpRuleError(  # J^T u is nonzero but does not depend on u: the backward cut it off
            f"{call}: {_subject(name)} has no forward-mode formula, and its backward is not differentiable in its "
            f"incoming gradient (it detaches it, or computes outside autograd), so double backward "
            f"through it would silently lose this path. Give it a forward-mode rule: for a custom "
            f"autograd.Function, a jvp staticmethod."
        )
    size = tangents[0].shape[0] if batched else None
    return [(torch.zeros_like(o) if size is None else o.new_zeros(size, *o.shape)) if r is None else r
            for r, o in zip(results, outputs)]


def _second_pass(pulled, us, tangents, batched):
    r""":math:`\partial_u \langle J^\top u, t\rangle` for each u; per tangent of the batch if ``batched``."""
    if not batched:
        return torch.autograd.grad(pulled, us, grad_outputs=tangents, allow_unused=True)
    size = tangents[0].shape[0]
    rows = [torch.autograd.grad(pulled, us, grad_outputs=[t[i] for t in tangents], allow_unused=True,
                                retain_graph=i + 1 < size) for i in range(size)]
    return [None if rows[0][j] is None else torch.stack([row[j] for row in rows]) for j in range(len(us))]
