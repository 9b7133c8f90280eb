r"""The local rule: one op's tangent by two reverse passes through that op alone.

.. math::

    \dot y = J_{\mathrm{op}}\, \dot x = \partial_u \big\langle J_{\mathrm{op}}^\top u,\ \dot x \big\rangle

For an op that forward mode cannot take (no formula, a formula that raises, one known to be
wrong, or a custom ``autograd.Function`` without ``jvp``), the op runs once on the primals of
its inputs with grad enabled, and :func:`mixedad._double_vjp.double_vjp` differentiates its
backward. The result goes on as a dual tensor, so the rest of G stays in forward mode.

Memory: the op's own graph (its saved tensors and its backward's graph), alive only while the
op runs; nothing accumulates across G's depth. Time: about one forward, one backward and one
double backward of that op. The op runs exactly once, so it draws the random numbers and
updates the buffers that its own call would.
"""
import torch

from mixedad._double_vjp import double_vjp
from mixedad._duals import dual, unpack
from mixedad._trees import tree_flatten, tree_unflatten


class NeedsWholeG(Exception):
    """Only the whole-G fallback can push the tangent through G: an op's outputs cannot carry
    forward-mode tangents at all (sparse layouts), or G's derivative depends on its reverse pass
    (G differentiates inside itself, changes gradients with hooks, or holds a custom Function
    whose backward is not linear in its incoming gradient).

    ``at_cotangent``: the fallback must evaluate G's backward at double backward's own cotangent
    :math:`u^* = \nabla_g f(y, g)`, because the backward may not be linear in it.
    """

    def __init__(self, reason, *, at_cotangent=False):
        super().__init__(reason)
        self.at_cotangent = at_cotangent


def _is_inplace(func):
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.startswith("__")


def local_jvp(call, name, func, args, kwargs, *, custom=False):
    """Run ``func(*args, **kwargs)`` with the local rule; NotImplemented if no input has a tangent.

    Args:
        call: the public call's name, for messages.
        name: the op's name, for messages.
        func: the op (a torch function, or a custom Function's ``apply`` bound to its class).
        args, kwargs: as the op was called, possibly holding dual tensors (nested in lists,
            tuples and dicts too).
        custom: keyword-only; True for a custom Function. Its inputs are then handed over as
            non-leaf copies, since it may write into them (``ctx.mark_dirty``); an output that
            is one of those copies is written back into the caller's tensor, tangent included.

    Returns:
        The op's result with the same structure; every floating-point output that depends on
        an input with a tangent is a dual tensor.
    """
    leaves, spec = tree_flatten((args, kwargs))
    work, diff, tangents = list(leaves), [], []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            primal, tangent = unpack(leaf) if leaf.layout == torch.strided else (leaf, None)
            work[i] = primal.detach()
            if tangent is not None:
                diff.append(i)
                tangents.append(tangent)
    if not diff:
        return NotImplemented
    inplace = _is_inplace(func)
    with torch.enable_grad():
        inputs = [work[i].requires_grad_() for i in diff]
        copied = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)] if custom else []
        if inplace and isinstance(leaves[0], torch.Tensor):
            copied = [0]  # the op writes into its first argument
        for i in copied:  # non-leaf copies to write into
            work[i] = work[i].clone()
        call_args, call_kwargs = tree_unflatten(work, spec)
        out = func(*call_args, **call_kwargs)
        if inplace and isinstance(leaves[0], torch.Tensor):
            out = work[0]
        out_leaves, out_spec = tree_flatten(out)
        # Outputs that are inputs written in place (ctx.mark_dirty, or an in-place torch op).
        written = {j: i for j, o in enumerate(out_leaves) for i in copied if o is work[i]}
        live = [j for j, o in enumerate(out_leaves)
                if isinstance(o, torch.Tensor) and o.requires_grad and (o.is_floating_point() or o.is_complex())]
        sparse = [out_leaves[j] for j in live if out_leaves[j].layout != torch.strided]
        if sparse:
            raise NeedsWholeG(f"{name} returns a {sparse[0].layout} tensor, which cannot carry a forward-mode "
                              f"tangent in PyTorch")
        out_tangents = double_vjp(call, name, [out_leaves[j] for j in live], inputs, tangents) if live else []
    result = [o.detach() if isinstance(o, torch.Tensor) else o for o in out_leaves]
    for j, t in zip(live, out_tangents):
        result[j] = dual(result[j], t)
    for j, i in written.items():
        leaves[i].copy_(result[j])  # forward AD carries the tangent into the caller's tensor
        result[j] = leaves[i]
    return tree_unflatten(result, out_spec)
