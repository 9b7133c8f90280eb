r"""Tangent formulas written out, for ops whose PyTorch formula is missing or unusable.

These are exact and cheaper than the local double-VJP rule, because they need no backward
pass. Each takes the user's own call for the primal, so ``G(z)`` is what a plain forward
computes, and returns NotImplemented where it does not apply (the op then takes the next path
in :mod:`mixedad.op_rules`).

**cdist.** ``torch.cdist`` has no forward-AD formula (``_cdist_forward`` and
``_euclidean_dist``), and on 25 rows or fewer its backward ``_cdist_backward`` cannot itself be
differentiated, so the local rule cannot take it either. With :math:`d_{ij} = \lVert a_i - b_j
\rVert_p`:

.. math::

    p = 2\colon\quad \dot d_{ij} = \frac{\langle a_i - b_j,\ \dot a_i - \dot b_j\rangle}{d_{ij}}
    = \frac{\langle a_i, \dot a_i\rangle - \langle \dot a_i, b_j\rangle - \langle a_i, \dot b_j\rangle
            + \langle b_j, \dot b_j\rangle}{d_{ij}}

four matrix products and no :math:`N \times M \times D` difference tensor; 0 where
:math:`d_{ij} = 0`, as PyTorch's backward gives. Other p go through forward AD of
``torch.linalg.vector_norm`` on the pairwise differences, which holds the
:math:`N \times M \times D` differences while the op runs.

**group_norm.** PyTorch's formula raises "view size is not compatible with input tensor's size
and stride" on channels-last and other non-contiguous inputs (diffusers' UNet2DModel). With
:math:`\hat x = (x - \mu)\,r` over each group, :math:`r = 1/\sqrt{\sigma^2 + \epsilon}`:

.. math::

    \dot y = \gamma\, r \Big(\dot x - \overline{\dot x} - \hat x\, \overline{\hat x \dot x}\Big)

where the bars are means over the group. Applies when weight and bias carry no tangent.

**Memory formats.** ``contiguous``, ``clone`` and ``to`` with ``memory_format=channels_last``
(or ``channels_last_3d``) copy their input into another layout: :math:`\dot y = \dot x` in
that layout. torch.func cannot batch these formulas (a batch of tangents would need the layout
of a tensor with one more dimension); the rule converts the k tangents as one batch of k times
the input's batch. Other calls of these methods take PyTorch's formula.
"""
import inspect

import torch
import torch.nn.functional as F

from mixedad._hooks.dual_level import dual, unpack
from mixedad.op_rules._table import Path, defrule

_CDIST_ARGS = ("x1", "x2", "p", "compute_mode")
_GROUP_NORM_ARGS = tuple(inspect.signature(F.group_norm).parameters)  # input, num_groups, weight, bias, eps


def _matches_primal(tangent, primal):
    return tangent if tangent.shape == primal.shape else tangent.expand(primal.shape).contiguous()


@defrule(Path.FORMULA, torch.cdist, reason="no forward-AD formula; its backward is not differentiable",
         arguments=_CDIST_ARGS)
def cdist_rule(op):
    """``torch.cdist(x1, x2, p, compute_mode)``: the primal call, and the tangent written out."""
    a, b = op.primals.get("x1"), op.primals.get("x2")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return NotImplemented
    da, db = op.tangents.get("x1"), op.tangents.get("x2")
    if da is None and db is None:
        return NotImplemented
    p = float(op.primals.get("p", 2.0))
    primal = op.primal()
    if p == 2.0:
        tangent = 0
        if da is not None:
            tangent = (a * da).sum(-1, keepdim=True) - da @ b.mT
        if db is not None:
            tangent = tangent - a @ db.mT + (b * db).sum(-1).unsqueeze(-2)
        tangent = torch.where(primal == 0, torch.zeros_like(primal), tangent / primal)
    else:
        diff = a.unsqueeze(-2) - b.unsqueeze(-3)
        zeros = torch.zeros((), dtype=diff.dtype, device=diff.device)
        d_diff = (zeros if da is None else da.unsqueeze(-2)) - (zeros if db is None else db.unsqueeze(-3))
        norm = torch.linalg.vector_norm(dual(diff, d_diff.expand(diff.shape)), ord=p, dim=-1)
        tangent = unpack(norm)[1]
    return primal, _matches_primal(tangent, primal)


@defrule(Path.FORMULA, F.group_norm, reason="PyTorch's formula raises on non-contiguous input",
         arguments=_GROUP_NORM_ARGS)
def group_norm_rule(op):
    """``F.group_norm`` with frozen affine parameters, on any memory layout."""
    x, dx = op.primals.get("input"), op.tangents.get("input")
    if not isinstance(x, torch.Tensor) or dx is None:
        return NotImplemented
    if op.tangents.get("weight") is not None or op.tangents.get("bias") is not None:
        return NotImplemented
    weight = op.primals.get("weight")
    primal = op.primal()
    if x.numel() == 0:
        return primal, torch.zeros_like(primal)
    groups, eps = op.primals["num_groups"], op.primals.get("eps", 1e-5)
    shape = (x.shape[0], groups, -1)
    xg, dxg = x.reshape(shape), dx.reshape(shape)
    mean = xg.mean(-1, keepdim=True)
    rstd = torch.rsqrt(xg.var(-1, unbiased=False, keepdim=True) + eps)
    x_hat = (xg - mean) * rstd
    d_hat = rstd * (dxg - dxg.mean(-1, keepdim=True) - x_hat * (x_hat * dxg).mean(-1, keepdim=True))
    tangent = d_hat.reshape(x.shape)
    if weight is not None:
        tangent = tangent * weight.reshape(1, -1, *([1] * (x.dim() - 2)))
    return primal, tangent


_MEMORY_FORMAT_KWARGS = {"memory_format", "non_blocking", "copy"}


@defrule(Path.FORMULA, torch.Tensor.contiguous, torch.Tensor.clone, torch.Tensor.to,
         reason="a change of memory format: the tangent in the same format", batched=True)
def memory_format_rule(op):
    """``x.contiguous / clone / to(memory_format=...)`` into a channels-last layout: the tangent converted alike."""
    fmt = op.kwargs.get("memory_format")
    if fmt is None or fmt in (torch.preserve_format, torch.contiguous_format):
        return NotImplemented
    if len(op.args) != 1 or set(op.kwargs) - _MEMORY_FORMAT_KWARGS:
        return NotImplemented  # a dtype or device change as well: PyTorch's formula
    tangent = op.tangents.get("arg0")
    if tangent is None:
        return NotImplemented
    kwargs = {name: op.primals[name] for name in op.kwargs}
    primal = op.primal()
    if not op.lowered:
        return primal, op.func(tangent, **kwargs)
    return primal, op.func(tangent.flatten(0, 1), **kwargs).unflatten(0, tangent.shape[:2])
