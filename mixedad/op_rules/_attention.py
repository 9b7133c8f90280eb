r"""The attention rule: the user's fused kernel for the primal, a blockwise tangent.

``F.scaled_dot_product_attention`` is what ``nn.MultiheadAttention``,
``nn.TransformerEncoderLayer``, HF transformers' "sdpa", timm's fused_attn and diffusers'
AttnProcessor2_0 reach. PyTorch's fused kernels (flash, memory-efficient, the CPU flash kernel)
have no forward-AD formula, and its math backend holds the :math:`T \times T` scores, the
probabilities and their tangents. This rule never holds them whole. With
:math:`S = \mathrm{scale}\cdot QK^\top + M`, :math:`P = \mathrm{softmax}(S)` and :math:`O = PV`:

.. math::

    \dot S = \mathrm{scale}\cdot(\dot Q K^\top + Q \dot K^\top), \qquad
    \dot O = P \dot V + (P \circ \dot S) V - \mathrm{rowsum}(P \circ \dot S) \circ O

computed one block of queries at a time (all batch entries and heads together), the block
chosen by bytes: about :data:`BLOCK_BYTES` of scores. With ``is_causal`` a block reads only the
keys its rows can see. Memory: O(block x T) for the scores plus the primal and tangent of the
output. Time: four matrix products per block (S, P dV, the stacked
:math:`[\dot Q, Q][K, \dot K]^\top` and :math:`(P \circ \dot S) V`) and a row sum of
:math:`P \circ \dot S`, on top of the fused primal. On the CPU, where SDPA takes
the flash kernel, the primal comes from that kernel called so that it also hands out each row's
log-sum-exp, and a block's probabilities are :math:`\exp(S - \mathrm{lse})`, the shift the
initial value of the product for S (one pass over the block, the exp, not a softmax's five). Terms of inputs without a tangent are skipped (a frozen K and
V, as in cross-attention to a fixed context, costs two products less). On CUDA the primal is the
flash or memory-efficient kernel that PyTorch picks; the tangent is the same code.

Covered: ``attn_mask`` (bool, True = attend, or additive), ``is_causal`` (top-left aligned, as
PyTorch's), ``scale``, ``enable_gqa``, query and key lengths that differ, any batch dimensions.
The primal is the user's own call, fused where the device has a kernel, so ``G(z)`` is what a
plain forward computes; the tangent uses that output :math:`O`. A query row that sees no key
(an all-False bool row, an all -inf additive row: a fully padded sequence, causal attention
over left padding) is 0 in PyTorch's kernels; its probabilities are 0 here too (a safe softmax
that never forms the NaN of an all -inf softmax), so its tangent is 0, as double backward's
derivative is. Rows masked only by large finite numbers (``finfo.min``) are ordinary rows.

Dropout (``dropout_p > 0``) and a mask that itself carries a tangent go through PyTorch's math
backend under forward AD instead: the fused kernels cannot hand out their dropout mask, and the
math backend draws exactly the random numbers double backward draws from the same state. That
path holds :math:`T \times T` tensors.
"""
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mixedad._hooks.attention_backends import fused_attention_with_lse, math_backend
from mixedad._hooks.composites import COMPOSITES, run_inside
from mixedad.op_rules._errors import UnderTransformError
from mixedad.op_rules._table import Path, defrule

#: Bytes of scores per block (all batch entries and heads, a block of queries, every key).
BLOCK_BYTES = 3 << 19  # 1.5 MiB

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _repeat_heads(t, repeats):
    return t if t is None or repeats == 1 else t.repeat_interleave(repeats, dim=-3)


def _block_rows(start, lq, lk, budget, is_causal):
    """How many query rows from ``start`` keep a block of scores within ``budget`` entries."""
    if not is_causal:
        return max(1, min(lq - start, budget // max(1, lk)))
    # rows r in [start, start + n) read min(lk, start + n) keys: n (start + n) <= budget
    n = int((-start + math.sqrt(start * start + 4 * budget)) / 2)
    if start + n > lk:
        n = budget // max(1, lk)
    return max(1, min(lq - start, n))


def _safe_softmax_(s):
    r"""Softmax over the last dim in place, 0 on rows that see no key (all -inf), as PyTorch's kernels give.

    .. math::

        P_{ij} = \frac{\exp(S_{ij} - m_i)}{\sum_k \exp(S_{ik} - m_i)}, \qquad
        m_i = \max_k S_{ik}, \quad\text{and } P_{i\cdot} = 0 \text{ where } m_i = -\infty

    A plain softmax of an all -inf row is NaN (:math:`-\infty - (-\infty)`); PyTorch's kernels
    give 0 there (the math backend's safe softmax), and so are the row's tangent and its
    derivative in double backward. Such a row is shifted by 0 instead of its max and divided by
    1 instead of its (zero) sum, so no NaN is ever formed; rows that mix -inf with finite
    entries (``finfo.min`` masks) are ordinary rows. No host synchronisation: it runs on meta
    tensors and under ``torch.func`` transforms.
    """
    top = s.amax(dim=-1, keepdim=True)
    blind = top == float("-inf")
    p = s.sub_(top.masked_fill_(blind, 0.0)).exp_()
    return p.div_(p.sum(dim=-1, keepdim=True).masked_fill_(blind, 1.0))


def _cat_last(tensors):
    """``torch.cat`` on the last dimension, broadcasting the others (a primal beside a batch of tangents)."""
    shape = torch.broadcast_shapes(*(t.shape[:-1] for t in tensors))
    return torch.cat([t.expand(*shape, t.shape[-1]) for t in tensors], dim=-1)


def blockwise_tangent(q, k, v, out, dq, dk, dv, *, attn_mask=None, is_causal=False, scale=None,
                      enable_gqa=False, block_bytes=None, batched=False, lse=None):
    r"""The tangent of ``out = scaled_dot_product_attention(q, k, v, ...)``, a block of queries at a time.

    .. math::

        \dot O = P \dot V + (P \circ \dot S) V - \mathrm{rowsum}(P \circ \dot S) \circ O

    ``dq``, ``dk`` and ``dv`` may be None (no tangent). With ``batched``, they carry a leading
    dimension k (a batch of tangents): the probabilities P of a block are computed once for all of
    them, no primal is copied k times, and the block budget is shared. ``lse``, where the primal's
    kernel gave it, is the log-sum-exp of each row of scores (shape ``q.shape[:-1]``): the
    probabilities of a block are then :math:`\exp(S - \mathrm{lse})`, two passes over the block
    instead of a softmax's five. Returns a tensor of ``out``'s shape (with the leading k when
    ``batched``) and dtype; float16 and bfloat16 are computed in float32.
    """
    lq, lk, e = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(e) if scale is None else scale
    if enable_gqa and k.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        repeats = q.shape[-3] // k.shape[-3]
        k, v, dk, dv = (_repeat_heads(t, repeats) for t in (k, v, dk, dv))
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    q, k, v, o, dq, dk, dv = (None if t is None else t.to(work) for t in (q, k, v, out, dq, dk, dv))
    if not batched:  # one tangent: a batch of one
        dq, dk, dv = (None if t is None else t.unsqueeze(0) for t in (dq, dk, dv))
    size = next(t.shape[0] for t in (dq, dk, dv, q.new_zeros(1)) if t is not None)
    # The tangents' batch dimension goes just before the rows (..., k, T, E); primals get a 1 there.
    dq, dk, dv = (None if t is None else t.movedim(0, -3) for t in (dq, dk, dv))
    q, k, v, o = (t.unsqueeze(-3) for t in (q, k, v, o))
    batch = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    ev = v.shape[-1]
    tangent = torch.zeros(*batch, size, lq, ev, dtype=work, device=q.device)
    if (dq is None and dk is None and dv is None) or lk == 0:  # no tangent, or no key to attend to
        return _unbatch(tangent, batched).to(out.dtype)
    mask = None if attn_mask is None else attn_mask.expand(*batch, lq, lk).unsqueeze(-3)
    budget = (BLOCK_BYTES if block_bytes is None else block_bytes) // (
        max(1, math.prod(batch) * size) * (torch.finfo(work).bits // 8))  # score entries per block
    # S = (scale Q) K^T, and dS = scale (dQ K^T + Q dK^T) as one product [scale dQ, scale Q] [K, dK]^T;
    # the scale is folded into the (T x E) factors once, not applied to every block of scores. Where both
    # are needed, scale Q is the second half of the left factor (a view), not a copy of its own.
    if dk is not None and size == 1:  # one tangent: scale Q is a view of the left factor
        left = _cat_last([dq * scale, q * scale]) if dq is not None else q * scale
        q_scaled = left[..., -e:]
    else:
        q_scaled = q * scale
        parts = [t for t in (None if dq is None else dq * scale, q_scaled if dk is not None else None) if t is not None]
        left = None if not parts else (parts[0] if len(parts) == 1 else _cat_last(parts))
    right = [t for t, d in ((k, dq), (dk, dk)) if d is not None]
    right = None if not right else (right[0] if len(right) == 1 else _cat_last(right))
    # The kernel's log-sum-exp, +inf on a row that sees no key (so that its P is 0, never NaN), negated: S - lse
    # is a product with -lse as its initial value (one pass over the block less than subtracting it after).
    neg_shift = None if lse is None else lse.to(work).unsqueeze(-1).unsqueeze(-3).nan_to_num(
        nan=math.inf, posinf=math.inf, neginf=math.inf).neg_()
    # P dV for all k tangents as one product: dV's k folded into its columns, (..., T, k E); one tangent: dV itself.
    dv_folded = None if dv is None else (dv.squeeze(-3) if size == 1 else dv.movedim(-3, -2).flatten(-2))
    v_flat = v.squeeze(-3)
    masks = {}
    for start, step in _blocks(lq, lk, budget, is_causal, plan_only=q.is_meta):
        rows = slice(start, start + step)
        # Causal attention (top-left aligned) reads keys 0..row only: later keys are skipped.
        cols = slice(0, min(lk, rows.stop) if is_causal else lk)
        s = _scores(q_scaled[..., rows, :], k[..., cols, :], None if neg_shift is None else neg_shift[..., rows, :])
        if mask is not None:
            block = mask[..., rows, cols]
            s = s.masked_fill_(~block, float("-inf")) if block.dtype == torch.bool else s.add_(block)
        if is_causal and start + 1 < cols.stop:  # only the keys beyond the block's first row
            later = (step, cols.stop - start - 1)
            if later not in masks:  # the blocks share a few shapes: each mask built once per call
                masks[later] = _later_keys(*later, q.device)
            s[..., start + 1:cols.stop].masked_fill_(masks[later], float("-inf"))
        p = s.exp_() if neg_shift is not None else _safe_softmax_(s)  # in place: s becomes P
        del s
        d_o = None
        if dv_folded is not None:
            d_o = (p.squeeze(-3) @ dv_folded[..., cols, :]).unflatten(-1, (size, ev)).movedim(-2, -3)
        if left is not None:
            p_ds = (left[..., rows, :] @ right[..., cols, :].mT).mul_(p)  # (..., k, rows, cols)
            del p
            # (P o dS) V with the k tangents stacked as rows: V is not copied k times; and the row sums of P o dS.
            row_sums = p_ds.sum(dim=-1, keepdim=True)
            pv = (p_ds.flatten(-3, -2) @ v_flat[..., cols, :]).unflatten(-2, (size, step))
            del p_ds  # before the term's temporaries: the block is the largest tensor here
            term = pv.sub_(row_sums * o[..., rows, :])
            d_o = term if d_o is None else term.add_(d_o)
        tangent[..., rows, :] = d_o
    return _unbatch(tangent, batched).to(out.dtype)


def _scores(q_scaled, k, neg_shift):
    r"""A block of scores :math:`(\mathrm{scale}\,Q) K^\top`, minus the log-sum-exp where given (``neg_shift``: -lse).

    Shape ``(..., 1, rows, cols)``, once for all tangents. The shift is the product's initial value
    (``baddbmm``) where Q and K have the same batch dimensions; else it is added after.
    """
    if neg_shift is None:
        return q_scaled @ k.mT
    if q_scaled.shape[:-2] != k.shape[:-2]:
        return (q_scaled @ k.mT).add_(neg_shift)
    batch, rows, cols = q_scaled.shape[:-2], q_scaled.shape[-2], k.shape[-2]
    s = torch.baddbmm(neg_shift.expand(*batch, rows, cols).reshape(-1, rows, cols), q_scaled.reshape(-1, rows, q_scaled.shape[-1]),
                      k.reshape(-1, cols, k.shape[-1]).mT)
    return s.reshape(*batch, rows, cols)


def _later_keys(rows, keys, device):
    """Which of the ``keys`` after a causal block's first row each of its ``rows`` must not see.

    Row i of the block (query ``start + i``) sees key ``start + 1 + j`` only if ``j < i``, wherever
    the block starts. Kept for one call only: under a fake or meta mode a tensor cached longer
    would outlive the mode.
    """
    return torch.ones(rows, keys, dtype=torch.bool, device=device).triu_()


def _blocks(lq, lk, budget, is_causal, plan_only=False):
    """``(start, rows)`` of each block of queries. With ``plan_only`` (meta tensors: a memory plan),
    only the block with the most scores: each block frees its scores before the next, so the
    largest one sets the peak, and a plan need not issue thousands of meta ops per layer."""
    blocks, start = [], 0
    while start < lq:
        step = _block_rows(start, lq, lk, budget, is_causal)
        blocks.append((start, step))
        start += step
    if plan_only:
        return [max(blocks, key=lambda b: b[1] * (min(lk, b[0] + b[1]) if is_causal else lk))]
    return blocks


def _unbatch(tangent, batched):
    """The tangent of :func:`blockwise_tangent` in the caller's layout: (k, ..., T, E), or (..., T, E)."""
    return tangent.movedim(-3, 0) if batched else tangent.squeeze(-3)


@defrule(Path.ATTENTION, F.scaled_dot_product_attention, reason="fused primal, blockwise tangent",
         arguments=_SDPA_ARGS, batched=True)
def sdpa_rule(op):
    """``F.scaled_dot_product_attention``: the user's kernel for the primal, the tangent blockwise."""
    q, k, v = (op.primals.get(name) for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return NotImplemented
    dq, dk, dv = (op.tangents.get(name) for name in ("query", "key", "value"))
    if dq is None and dk is None and dv is None:
        return NotImplemented
    mask = op.primals.get("attn_mask")
    if op.primals.get("dropout_p", 0.0) > 0 or op.tangents.get("attn_mask") is not None:
        reason = "dropout: math backend" if op.primals.get("dropout_p", 0.0) > 0 else "mask with a tangent: math backend"
        if op.lowered:
            raise UnderTransformError(f"{op.call}: attention with {reason.split(':')[0]} takes PyTorch's math backend, "
                                      f"one tangent per pass")
        op.reroute(Path.FORWARD, reason)
        with math_backend():
            return op.func(*op.args, **op.kwargs), None  # forward AD through the math backend's ops
    is_causal, scale = op.primals.get("is_causal", False), op.primals.get("scale")
    fused = None
    if (not op.primals.get("enable_gqa", False) and q.device.type in ("cpu", "meta")
            and not _rows_masked_by_large_numbers(mask)):  # (reads the mask: only where the kernel may be taken)
        # The kernel SDPA takes, called so that it also hands out its row statistics (the CPU flash kernel);
        # not for rows masked by large finite numbers, whose log-sum-exp is rounded at that number.
        fused = fused_attention_with_lse(q, k, v, mask, is_causal, scale)
    primal, lse = fused if fused is not None else (op.primal(), None)
    tangent = blockwise_tangent(q, k, v, primal, dq, dk, dv, attn_mask=mask, is_causal=is_causal, scale=scale,
                                enable_gqa=op.primals.get("enable_gqa", False), batched=op.lowered, lse=lse)
    return primal, tangent


#: A mask row whose largest finite entry lies below this masks its keys "by a large number"
#: (-1e4, -1e9, ``finfo.min``: HF-style masks on the padded queries of a left-padded batch).
FAR_NEGATIVE = -1024.0


def _rows_masked_by_large_numbers(mask):
    r"""Whether some row of an additive mask sees only keys masked by large finite numbers.

    .. math::

        \exists\, i:\quad -\infty < \max_j M_{ij} < \mathrm{FAR\_NEGATIVE}

    PyTorch's fused kernels compute such a row's output right, but their backward recomputes
    its probabilities as :math:`\exp(S_{ij} - \mathrm{lse}_i)` with :math:`\mathrm{lse}_i`
    rounded at :math:`|\max_j M_{ij}|`: off by about :math:`|\max_j M_{ij}|\,\epsilon` relative,
    and summing to the number of keys instead of 1 on an all ``finfo.min`` row. The math backend
    (double backward's) is exact there. Rows that see no key at all (-inf) are right in both.
    Bool masks and masks absent: False; so are masks without data to read (meta tensors, and
    fake ones, whose storage is on meta), which keep the user's kernel.
    """
    if mask is None or not mask.is_floating_point() or mask.untyped_storage().device.type == "meta":
        return False
    top = mask.detach().amax(dim=-1)
    return bool(((top < FAR_NEGATIVE) & (top > float("-inf"))).any())


def _needs_math_backend(args, kwargs):
    bound = dict(zip(_SDPA_ARGS, args), **kwargs)
    return bound.get("dropout_p", 0.0) > 0 or _rows_masked_by_large_numbers(bound.get("attn_mask"))


class MathBackendWhereFusedDiffers(TorchFunctionMode):
    r"""Attention on PyTorch's math backend where the fused kernels' backward would differ; else the user's kernels.

    For the reverse passes that mixedad's forward-AD pass replays (``input_grad``'s forward).
    Two cases take the math backend: dropout (the replay runs attention with dropout on the
    math backend, so the pass it replays must draw the same masks there), and additive masks
    with rows masked only by large finite numbers, where the fused backward is inexact (see
    :func:`_rows_masked_by_large_numbers`); such a call holds :math:`T \times T` scores.
    Inner calls of ``F.multi_head_attention_forward`` are reached.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in COMPOSITES:
            return run_inside(self, func, args, kwargs)
        if func is F.scaled_dot_product_attention and _needs_math_backend(args, kwargs):
            with math_backend():
                return func(*args, **kwargs)
        return func(*args, **kwargs)
