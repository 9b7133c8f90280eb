"""Pushing tangents forward through a frozen generator G.

This is mixedad's front end: one forward-mode pass through G computes G(z) and the
Jacobian-vector product J_G(z) v together, keeping only the activations of the layer being
evaluated. No reverse graph through G is recorded, even when G's parameters require grad.
"""
import torch
from torch import nn
from torch.func import functional_call, jvp

from mixedad._trees import describe, tree_flatten


def push_tangent(call, G, z, v):
    r"""Evaluate G at z and push the tangent v through it.

    .. math::

        g = G(z), \qquad \dot g = J_G(z)\, v

    Runs ``torch.func.jvp`` under ``torch.no_grad()``: forward-mode AD is not affected by
    no_grad, and no_grad stops autograd from recording G's parameters. Memory is that of a
    forward pass holding primal and tangent, independent of G's depth.

    Args:
        call: the public call's name, for error messages.
        G: callable taking z and returning a tensor or a pytree of tensors.
        z: the primal input (detached before use).
        v: the tangent, z's shape, dtype and device.

    Returns:
        ``(g_leaves, tangent_leaves, spec)``: the flattened output of G, the matching flattened
        tangents (detached, no graph) and the pytree spec of G's output.
    """
    with torch.no_grad():
        g, g_dot = jvp(G, (z.detach(),), (v.detach(),))
    g_leaves, spec = tree_flatten(g)
    tangent_leaves, _ = tree_flatten(g_dot)
    for i, leaf in enumerate(g_leaves):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            where = "G(z)" if len(g_leaves) == 1 else f"G(z)'s leaf {i}"
            raise TypeError(
                f"{call}: expected {where} to be a floating-point tensor, got {describe(leaf)}."
            )
    return g_leaves, tangent_leaves, spec


def frozen(G):
    """G as a callable whose parameters are constants for autograd.

    For an ``nn.Module``, the call goes through ``torch.func.functional_call`` with detached
    parameters: autograd then neither records G's parameters nor keeps the activations their
    gradients would need, and the module's requires_grad flags are never touched. Other
    callables are returned as they are.
    """
    if not isinstance(G, nn.Module):
        return G

    def call(*args):
        params = {name: p.detach() for name, p in G.named_parameters()}
        return functional_call(G, params, args)

    return call
