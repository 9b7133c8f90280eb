r"""The attention rule: primal and tangent in blocks of queries on the CPU; elsewhere the user's kernel and a blockwise tangent.

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
keys its rows can see. Memory: two buffers of a block's scores (allocated once per call) plus
the primal and tangent of the output, O(block x T). Time per block: the product for S, one
softmax, the products :math:`PV` and :math:`P\dot V`, the product for :math:`\dot S` (one, of
inner dimension 2E, :math:`[\dot Q, Q][K, \dot K]^\top`, where both tangents are there),
:math:`(P \circ \dot S) V` and a row sum of :math:`P \circ \dot S`. Terms of inputs without a
tangent are skipped (a frozen K and V, as in cross-attention to a fixed context, costs two
products less).

On the CPU the primal :math:`O` comes from the same blocks: the CPU's flash kernel would compute
every score once more, and the tangent needs the probabilities anyway (the primal then costs one
product of the block, :math:`PV`). ``G(z)`` is then a plain forward's to round-off (the same
products and softmax in another order), not bit for bit. On CUDA, under CPU autocast (where SDPA
picks the dtype), where the inputs need a graph, and for tensor subclasses, the primal is the
user's own call (the flash or memory-efficient kernel PyTorch picks), and the tangent is the same
code given that output (:func:`mixedad._hooks.attention_backends.blockwise_primal_here`).

Covered: ``attn_mask`` (bool, True = attend, or additive), ``is_causal`` (top-left aligned, as
PyTorch's), ``scale``, ``enable_gqa``, query and key lengths that differ, any batch dimensions.
A query row that sees no key (an all-False bool row, an all -inf additive row: a fully padded
sequence, causal attention over left padding) is 0 in PyTorch's kernels; its probabilities are
0 here too (a safe softmax that never forms the NaN of an all -inf softmax), so its primal and
tangent are 0, as double backward's derivative is. Rows masked only by large finite numbers
(``finfo.min``) are ordinary rows, exact here (the fused kernels' backward is not: see
:func:`_rows_masked_by_large_numbers`).

Dropout (``dropout_p > 0``) and a mask that itself carries a tangent go through PyTorch's math
backend under forward AD instead: the fused kernels cannot hand out their dropout mask, and the
math backend draws exactly the random numbers double backward draws from the same state. That
path holds :math:`T \times T` tensors.
"""
import contextlib
import math
import threading
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mixedad._hooks.attention_backends import blockwise_primal_here, math_backend, meta_stand_in, output_tokens_first
from mixedad._hooks.composites import COMPOSITES, run_inside
from mixedad._hooks.thread_local import setting
from mixedad._ground.errors import UnderTransformError
from mixedad.op_rules._table import Path, defrule

#: Bytes of scores per block (all batch entries and heads, a block of queries, every key).
BLOCK_BYTES = 3 << 19  # 1.5 MiB
_BLOCKS = threading.local()


@contextlib.contextmanager
def attention_blocks(nbytes: int) -> Iterator[None]:
    r"""Inside the block, the attention rule's blocks of queries hold about ``nbytes`` of scores (this thread).

    .. math::

        \text{rows per block} \approx \frac{\mathtt{nbytes}}{\text{batch} \cdot \text{heads} \cdot T_k \cdot
        \text{bytes per score}}

    The default, 1.5 MiB, is sized for a CPU's cache. Each block costs a dozen kernel launches, which on
    a GPU dominate at the default (docs/performance.md, "Measurements behind the design").
    Larger blocks launch fewer kernels and hold more at once (the peak grows by a few blocks, still
    flat in T). A memory plan (:func:`mixedad.profiling.plan`) made inside the block plans those blocks.

    Example:
        >>> import torch, mixedad
        >>> G = mixedad.zoo.attention_stack(16, nhead=2, layers=1)
        >>> z = torch.randn(1, 64, 16)
        >>> with mixedad.op_rules.attention_blocks(64 << 20):
        ...     out = mixedad.mixed_grad(lambda y, g: (g * y).sum(), G, z, z, z)
        >>> out.shape
        torch.Size([1, 64, 16])

    Raises:
        ValueError: ``nbytes`` is not a positive integer.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"attention_blocks(nbytes): expected a positive number of bytes, got {nbytes!r}.")
    with setting(_BLOCKS, "nbytes", nbytes):
        yield

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


def _probabilities(s, masked, out=None):
    r"""The softmax of a block of scores over its last dim; 0 on rows that see no key (all -inf), as PyTorch's kernels give.

    .. math::

        P_{ij} = \frac{\exp(S_{ij} - m_i)}{\sum_k \exp(S_{ik} - m_i)}, \qquad
        m_i = \max_k S_{ik}, \quad\text{and } P_{i\cdot} = 0 \text{ where } m_i = -\infty

    Without a mask (``masked`` False) every row sees a key, and this is ``torch.softmax``. With
    one, a row may see none: a plain softmax of an all -inf row is NaN; PyTorch's kernels give 0
    there (the math backend's safe softmax), and so are the row's tangent and its derivative in
    double backward. Such rows are set to 0 before the softmax and their probabilities to 0 after,
    so no NaN is ever formed; rows that mix -inf with finite entries (``finfo.min`` masks) are
    ordinary rows. ``s`` may be overwritten; ``out``, where given, receives P. No host
    synchronisation: it runs on meta tensors and under ``torch.func`` transforms.
    """
    blind = s.amax(dim=-1, keepdim=True) == float("-inf") if masked else None
    if blind is not None:
        s = s.masked_fill_(blind, 0.0)
    p = torch.softmax(s, dim=-1) if out is None else torch.softmax(s, dim=-1, out=out)
    if blind is None:
        return p
    return p.masked_fill(blind, 0.0) if p.requires_grad else p.masked_fill_(blind, 0.0)  # softmax's backward reads p


def blockwise_tangent(q, k, v, out, dq, dk, dv, **options):
    r"""The tangent of ``out = scaled_dot_product_attention(q, k, v, ...)``, a block of queries at a time.

    :func:`blockwise_attention` with the primal given (the user's kernel computed it): returns the
    tangent alone.
    """
    return blockwise_attention(q, k, v, dq, dk, dv, out=out, **options)[1]


def blockwise_attention(q, k, v, dq, dk, dv, *, out=None, attn_mask=None, is_causal=False, scale=None,
                        enable_gqa=False, block_bytes=None, batched=False, tokens_first=False):
    r"""``(out, tangent)`` of ``scaled_dot_product_attention(q, k, v, ...)``, a block of queries at a time.

    .. math::

        O = P V, \qquad \dot O = P \dot V + (P \circ \dot S) V - \mathrm{rowsum}(P \circ \dot S) \circ O

    ``dq``, ``dk`` and ``dv`` may be None (no tangent). With ``out`` (the primal the user's kernel
    gave), only the tangent is computed and ``out`` is returned as it is; without it, each block's
    rows of :math:`O` come from the same probabilities as the tangent, one more product
    :math:`PV`, and ``tokens_first`` lays them out in memory as ``(B, T, H, E)`` (as the CPU's
    flash kernel does; else contiguous). The tangent takes the primal's layout. With ``batched``,
    the tangents carry a leading dimension k (a batch of tangents): the probabilities of a block
    are computed once for all of them, no primal is copied k times, and the block budget is
    shared. Returns tensors of the attention's shape (the tangent with the leading k when
    ``batched``) and dtype; float16 and bfloat16 are computed in float32. Where no input needs a
    graph, the blocks' scores are written into two buffers allocated once per call, so that a
    call costs no allocation per block.
    """
    lq, lk, e, ev = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    scale = 1.0 / math.sqrt(e) if scale is None else scale
    if q.is_meta and attn_mask is not None and not attn_mask.is_meta:  # a plan: a mask G holds on another device
        attn_mask = meta_stand_in(attn_mask)
    if enable_gqa and q.dim() >= 3:  # each of key and value repeated up to the query's heads
        k, dk = (_repeat_heads(t, q.shape[-3] // k.shape[-3]) for t in (k, dk))
        v, dv = (_repeat_heads(t, q.shape[-3] // v.shape[-3]) for t in (v, dv))
    graph = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, out, dq, dk, dv))
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    if not batched:  # one tangent: a batch of one
        dq, dk, dv = (None if t is None else t.unsqueeze(0) for t in (dq, dk, dv))
    size = next((t.shape[0] for t in (dq, dk, dv) if t is not None), 1)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    n = math.prod(batch)
    dtype = q.dtype if out is None else out.dtype
    # The results in the layout SDPA gives its output; the tangent in the primal's, the k tangents outermost.
    if out is not None:
        primal = out
    elif tokens_first and len(batch) == 2:  # (B, T, H, E) in memory
        primal = torch.zeros(batch[0], lq, batch[1], ev, dtype=work, device=q.device).transpose(1, 2)
    else:
        primal = torch.zeros(*batch, lq, ev, dtype=work, device=q.device)
    tangent = _zeros_in_layout(primal, (size, *batch, lq, ev), work)
    if lk == 0 or lq == 0 or (dq is None and dk is None and dv is None):  # no key to attend to: SDPA gives 0
        return (out if out is not None else primal.to(dtype)), _unbatch(tangent, batched).to(dtype)
    # Each product is a single bmm on 3-d views of the inputs (copies only where their batch dims cannot be
    # merged): primals (n, T, E), tangents (n k, T, E), the k tangents of a batch entry side by side, so that
    # (P o dS) V stacks them as rows against one V. The scale is the products' alpha.
    v3 = _flat(v, work, batch)
    # The tangents as views (*batch, k, T, E), copied once, into the factors below
    dq4, dk4, dv4 = (None if t is None else t.movedim(0, -3).expand(*batch, size, *t.shape[-2:]) for t in (dq, dk, dv))
    # dS = scale (dQ K^T + Q dK^T): with both tangents, one product [dQ, Q] [K, dK]^T of inner dim 2E (faster than
    # two of E), whose factors hold Q and K for the scores too; with one, that one's product with the other primal.
    if dq4 is not None and dk4 is not None:
        factors = tuple(torch.cat(pair, dim=-1).to(work).reshape(n * size, pair[0].shape[-2], 2 * e)
                        for pair in ((dq4, _for_each_tangent(q, dq4)), (_for_each_tangent(k, dk4), dk4)))
        q3, k3 = factors[0].unflatten(0, (n, size))[:, 0, :, e:], factors[1].unflatten(0, (n, size))[:, 0, :, :e]
    else:
        q3, k3 = _flat(q, work, batch), _flat(k, work, batch)
        if dq4 is not None:
            factors = (_flat(dq4, work, (*batch, size)), k3)
        elif dk4 is not None:
            factors = (q3, _flat(dk4, work, (*batch, size)))
    # P dV for the k tangents as one product: dV's k folded into its columns, (n, T, k E)
    dv_folded = None if dv4 is None else dv4.transpose(-3, -2).to(work).reshape(n, lk, size * ev)
    with_score_tangent = dq4 is not None or dk4 is not None
    o3 = None if out is None else _flat(out, work, batch)
    mask = None if attn_mask is None else attn_mask.expand(*batch, lq, lk)
    if block_bytes is None:
        block_bytes = getattr(_BLOCKS, "nbytes", None) or BLOCK_BYTES  # attention_blocks' size, or the default
    budget = block_bytes // (
        max(1, n * size) * (torch.finfo(work).bits // 8))  # score entries per block
    blocks = _blocks(lq, lk, budget, is_causal, plan_only=q.is_meta)
    most = max(step * (min(lk, start + step) if is_causal else lk) for start, step in blocks)
    # Where no graph is built, each block's scores (then its dS, k of them) and probabilities are written into two
    # buffers allocated once per call: a fresh block-sized tensor can cost more than the product filling it (a
    # 1.5 MB bmm result measured 3x the time of the same product into a buffer, on the CPU).
    buffer, probabilities = (None, None) if graph else (q3.new_zeros(n * size * most), q3.new_zeros(n * most))
    # Causal blocks (top-left aligned) mask the keys beyond each row: one triangle, sliced for every block.
    most_rows = max(step for _, step in blocks)
    later_keys = _later_keys(most_rows, most_rows - 1, q.device) if is_causal else None
    minus_inf = None if mask is None or mask.dtype != torch.bool else q3.new_full((), float("-inf"))
    count = size * n
    # Each block's rows of the queries, the outputs and the tangent, cut in one call each (a view per block).
    q_rows = _rows(q3, 1, blocks)
    f_rows = _rows(factors[0], 1, blocks) if with_score_tangent else None
    o_block = _rows(primal if out is None else o3, -2 if out is None else 1, blocks)
    t_block = _rows(tangent, -2, blocks)
    single = size == 1
    # The keys' factors transposed once, (n, E, T); a primal factor of a batch entry is repeated for its k tangents
    k3t = k3.mT
    keys_t = factors[1].mT if with_score_tangent else None
    repeats = count // n
    for b, (start, step) in enumerate(blocks):  # (narrow, not [:, a:b]: one op, not two, per slice)
        stop = min(lk, start + step) if is_causal else lk  # causal: keys 0..row only
        v_keys = v3 if stop == lk else v3.narrow(1, 0, stop)
        s = _product(q_rows[b], k3t if stop == lk else k3t.narrow(2, 0, stop), scale, buffer)
        if mask is not None:
            block, shaped = mask.narrow(-2, start, step).narrow(-1, 0, stop), s.view(*batch, step, stop)
            torch.where(block, shaped, minus_inf, out=shaped) if minus_inf is not None else shaped.add_(block)
        if is_causal and start + 1 < stop:  # the keys beyond the block's first row: a corner of the triangle
            later = stop - start - 1
            s.narrow(2, start + 1, later).masked_fill_(later_keys.as_strided((step, later), later_keys.stride()),
                                                       float("-inf"))
        p = _probabilities(s, mask is not None, None if probabilities is None else _front(probabilities, s.shape))
        del s
        if out is None:  # the primal's rows
            o_rows = torch.bmm(p, v_keys)
            o_block[b].copy_(o_rows.view(*batch, step, ev))
        else:
            o_rows = o_block[b]
        # The k tangents as (n, k rows, E), the k tangents of a batch entry stacked as rows (one tangent: (n, rows, E))
        d_o = None
        if dv_folded is not None:  # P dV: (n, rows, k E), its k column blocks stacked as rows
            d_o = torch.bmm(p, dv_folded if stop == lk else dv_folded.narrow(1, 0, stop))
            if not single:
                d_o = d_o.view(n, step, size, ev).transpose(1, 2).reshape(n, size * step, ev)
        if with_score_tangent:  # dS into the buffer, then P o dS in place: (n, k rows, keys)
            keys = keys_t if stop == lk else keys_t.narrow(2, 0, stop)
            p_ds = _product(f_rows[b] if repeats == 1 else _repeated(f_rows[b], count),
                            keys if repeats == 1 else _repeated(keys, count), scale, buffer)
            p_ds = p_ds.mul_(p) if single else p_ds.view(n, size, step, stop).mul_(p.unsqueeze(1)).view(n, -1, stop)
            del p
            # (P o dS) V - rowsum(P o dS) o O, onto P dV in the product; O shared by the k tangents
            row_sums = p_ds.sum(dim=-1, keepdim=True)
            term = torch.bmm(p_ds, v_keys) if d_o is None else torch.baddbmm(d_o, p_ds, v_keys)
            del p_ds
            d_o = term if single else term.view(n, size, step, ev)
            d_o.addcmul_(row_sums.view(d_o.shape[:-1] + (1,)), o_rows.view(n, step, ev) if single else
                         o_rows.view(n, 1, step, ev), value=-1)
        t_block[b].copy_(d_o.view(t_block[b].shape) if single else
                         d_o.view(n, size, step, ev).movedim(1, 0).reshape(t_block[b].shape))
        d_o = term = row_sums = o_rows = None  # not held while the next block allocates its own
    result = primal.to(dtype) if out is None else out
    return result, _unbatch(tangent, batched).to(dtype)


def _flat(t, dtype, batch):
    """``t`` (batch dims broadcastable to ``batch``) as a 3-d ``(prod(batch), T, E)`` tensor of ``dtype``: a view
    where its batch dims merge, else a copy."""
    t = t.to(dtype)
    return t.expand(*batch, *t.shape[-2:]).reshape(math.prod(batch), *t.shape[-2:])


def _for_each_tangent(t, tangent):
    """A primal ``(*batch', T, E)`` as a view of the shape of ``tangent`` (``(*batch, k, T, E)``): its k copies."""
    return t.unsqueeze(-3).expand(*tangent.shape[:-1], t.shape[-1])


def _repeated(t, count):
    """A primal's ``(n, T, E)`` as ``(count, T, E)``, each batch entry repeated for its ``count / n`` tangents (side
    by side), or ``t`` itself where ``count`` is n."""
    if t.shape[0] == count:
        return t
    return t.unsqueeze(1).expand(t.shape[0], count // t.shape[0], *t.shape[1:]).flatten(0, 1)


def _product(a, b_t, alpha, buffer):
    r"""``alpha * a @ b_t`` (3-d), written into the front of ``buffer`` where one is given (no allocation per block)."""
    if buffer is None:
        return torch.bmm(a, b_t).mul_(alpha)
    out = _front(buffer, (a.shape[0], a.shape[1], b_t.shape[2]))
    return torch.baddbmm(out, a, b_t, beta=0, alpha=alpha, out=out)


def _front(buffer, shape):
    """The front of a flat ``buffer`` as a contiguous tensor of ``shape``."""
    strides, size = [], 1
    for extent in reversed(shape):
        strides.append(size)
        size *= extent
    return buffer.as_strided(shape, strides[::-1])


def _rows(t, dim, blocks):
    """A view of ``t`` per block, its rows ``start:start + step`` along ``dim``: cut in one call where the blocks
    tile the rows (a plan's do not: it runs two of them)."""
    steps = [step for _, step in blocks]
    if blocks[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(blocks, blocks[1:])) and \
            blocks[-1][0] + steps[-1] == t.shape[dim]:
        return t.split(steps, dim)
    return [t.narrow(dim, start, step) for start, step in blocks]


def _zeros_in_layout(like, shape, dtype):
    """Zeros of ``shape`` whose last ``like.dim()`` dimensions lie in memory in the order of ``like``'s strides
    (any leading ones outermost). Zeros, not empty: a mode that watches for NaN would see stale memory's."""
    lead = len(shape) - like.dim()
    order = list(range(lead)) + sorted(range(lead, len(shape)), key=lambda d: -like.stride(d - lead))
    return torch.zeros([shape[d] for d in order], dtype=dtype, device=like.device).permute(
        [order.index(d) for d in range(len(shape))])


def _later_keys(rows, keys, device):
    """Which of the ``keys`` after a causal block's first row each of its ``rows`` must not see.

    Row i of the block (query ``start + i``) sees key ``start + 1 + j`` only if ``j < i``, wherever
    the block starts; a block of r rows and m such keys reads the top-left ``[:r, :m]`` of this
    triangle. Kept for one call only: under a fake or meta mode a tensor cached longer would
    outlive the mode.
    """
    return torch.ones(rows, keys, dtype=torch.bool, device=device).triu_()


def _blocks(lq, lk, budget, is_causal, plan_only=False):
    """``(start, rows)`` of each block of queries. With ``plan_only`` (meta tensors: a memory plan),
    only the block with the most scores and the one with the most rows: the buffers are sized by
    the first, a block's own temporaries grow with its rows (causal blocks: the early ones), so
    one of the two sets the peak, and a plan need not issue thousands of meta ops per layer."""
    blocks, start = [], 0
    while start < lq:
        step = _block_rows(start, lq, lk, budget, is_causal)
        blocks.append((start, step))
        start += step
    if plan_only:
        largest = max(blocks, key=lambda b: b[1] * (min(lk, b[0] + b[1]) if is_causal else lk))
        tallest = max(blocks, key=lambda b: b[1])
        return sorted({largest, tallest})
    return blocks


def _unbatch(tangent, batched):
    """The ``(k, ..., T, E)`` tangent of :func:`blockwise_attention` in the caller's layout: as it is, or (..., T, E)."""
    return tangent if batched else tangent.squeeze(0)


@defrule(Path.ATTENTION, F.scaled_dot_product_attention, reason="blockwise attention",
         arguments=_SDPA_ARGS, batched=True)
def sdpa_rule(op):
    """``F.scaled_dot_product_attention``: primal and tangent blockwise on the CPU, the tangent alone elsewhere."""
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
    options = {"attn_mask": mask, "is_causal": op.primals.get("is_causal", False), "scale": op.primals.get("scale"),
               "enable_gqa": op.primals.get("enable_gqa", False)}
    return attention(op.primal, q, k, v, dq, dk, dv, batched=op.lowered, **options)


def attention(user_kernel, q, k, v, dq, dk, dv, **options):
    """``(out, tangent)`` of ``F.scaled_dot_product_attention`` without dropout: mixedad's attention rule.

    On the CPU the primal comes from the blocks of the tangent (:func:`blockwise_attention`): the
    CPU's fused kernel would compute every score once more. Elsewhere (CUDA's fused kernels, CPU
    autocast, inputs that need a graph, tensor subclasses, inputs SDPA refuses) the primal is
    ``user_kernel()``, the user's own call, and the tangent is computed from it.
    """
    mask, causal, gqa = options.get("attn_mask"), options.get("is_causal", False), options.get("enable_gqa", False)
    if blockwise_primal_here(q, k, v, mask, causal, gqa):
        tokens_first = output_tokens_first(q, k, v, mask, causal, options.get("scale"), gqa)
        return blockwise_attention(q, k, v, dq, dk, dv, tokens_first=tokens_first, **options)
    out = user_kernel()
    return out, blockwise_tangent(q, k, v, out, dq, dk, dv, **options)


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
