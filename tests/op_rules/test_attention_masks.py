"""Attention rows that see no key, as data: 0 as in PyTorch's kernels, exact against double backward.

A query row whose keys are all masked (an all-False bool row, an all -inf additive row, a key
padding mask over a whole sequence, causal attention plus left padding) is 0 in PyTorch's SDPA
kernels, and double backward through the math backend (PyTorch's safe softmax) is finite there.
A plain softmax of such a row is NaN. Every case below is a small G (float64 unless named
``_f32``) checked four ways against :mod:`mixedad.reference`:

- ``mixed_grad`` with a non-linear f, and the tangent :math:`J_G v` itself (``mixed_grad`` with
  f linear in g); rows that torch's output has at 0 must have a tangent of exactly 0;
- ``input_grad``, whole and chunked (``chunk_size=1``, where G takes any batch size), and the
  gradient of y through its backward;
- ``mixed_jacobian`` (under ``torch.func.vmap``, on the math backend).

Every result must be free of NaN and within ``mixedad.testing.RTOL`` of the reference (1e-9 in
float64). ``python tests/test_attention_masks.py`` prints the table of verdicts and errors.

Rows masked only by ``finfo.min`` (HF-style masks on padded queries) are not blind: torch gives
them a uniform average over the masked keys. PyTorch's fused backward is inexact on them (its
logsumexp rounds at ``finfo.min``), so ``input_grad``'s forward takes the math backend there.
"""
import contextlib
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import mixedad
from mixedad.op_rules import _attention
from mixedad.profiling import cpu_peak_memory
from mixedad.reference import double_backward_input_grad, double_backward_mixed_grad, double_backward_mixed_jacobian
from mixedad.testing import RTOL, assert_close, max_relative_error

F64, F32 = torch.float64, torch.float32
NEG_INF = float("-inf")

# ----------------------------------------------------------------------------------------------
# The case table
# ----------------------------------------------------------------------------------------------

CASES = {}


def case(*, random=False, chunkable=False, attention=False, dtypes=(F64,)):
    """Register a builder ``build(dtype) -> G, z``.

    ``random``: G draws dropout masks (every call is seeded alike); ``chunkable``: G takes any
    number of codes along z's dim 0 (for ``input_grad(chunk_size=1)``); ``attention``: G's output
    is the SDPA output itself, so its zero rows are the rows that see no key.
    """

    def register(build):
        for dtype in dtypes:
            name = build.__name__ + ("" if dtype == F64 else "_f32")
            CASES[name] = types.SimpleNamespace(name=name, build=build, dtype=dtype, random=random,
                                                chunkable=chunkable, attention=attention)
        return build

    return register


def generator(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=F64, seed=0, scale=1.0):
    return torch.randn(*shape, generator=generator(seed), dtype=F64).mul_(scale).to(dtype)


def weight(n_in, n_out, *, dtype, seed):
    return randn(n_in, n_out, dtype=dtype, seed=seed, scale=1.5 / n_in ** 0.5)


def additive(allowed, dtype):
    """The additive mask of a bool mask: 0 where True, -inf where False."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, NEG_INF)


def sdpa_generator(mask=None, *, N=2, H=2, L=4, S=4, E=3, kv_heads=None, frozen_kv=False, dtype=F64, **kwargs):
    """G(z) = SDPA(q, k, v) with q, k, v projected from z of shape (N, H, L, E) ((H, L, E) when N is None).

    Keys and values come from S positions cycled out of z (or from constants, ``frozen_kv``);
    ``kv_heads`` keeps that many key and value heads (grouped-query attention).
    """
    Wq, Wk, Wv = (weight(E, E, dtype=dtype, seed=s) for s in (1, 2, 3))
    batch = () if N is None else (N,)
    K0, V0 = randn(*batch, H, S, E, dtype=dtype, seed=4), randn(*batch, H, S, E, dtype=dtype, seed=5)
    if kv_heads is not None:
        kwargs["enable_gqa"] = True

    def G(z):
        q = z @ Wq
        if frozen_kv:
            k, v = K0, V0
        else:
            src = torch.cat([z, z.flip(-2), z], dim=-2)[..., :S, :]
            k, v = src @ Wk, torch.sin(src @ Wv)
        if kv_heads is not None:
            k, v = k[..., :kv_heads, :, :], v[..., :kv_heads, :, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)

    return G, randn(*batch, H, L, E, dtype=dtype, seed=6)


def bool_mask(*shape, seed, blind=()):
    """A random bool mask (True = attend) in which every row sees a key, except the rows ``blind``."""
    allowed = torch.rand(*shape, generator=generator(seed)) > 0.5
    allowed[..., 0] = True
    for index in blind:
        allowed[index] = False
    return allowed


@case(attention=True, chunkable=True, dtypes=(F64, F32))
def sdpa_bool_LS_all_false_row(dtype):
    return sdpa_generator(bool_mask(4, 4, seed=1, blind=[1]), dtype=dtype)


@case(attention=True, chunkable=True, dtypes=(F64, F32))
def sdpa_additive_LS_all_neg_inf_row(dtype):
    mask = randn(4, 4, dtype=dtype, seed=7)
    mask[2] = NEG_INF
    mask[0, 3] = NEG_INF
    return sdpa_generator(mask, dtype=dtype)


@case(attention=True, dtypes=(F64, F32))
def sdpa_additive_NHLS_neg_inf_rows_beside_normal_rows(dtype):
    mask = randn(2, 2, 4, 4, dtype=dtype, seed=7)
    mask[0, 1, 3] = NEG_INF         # one head of one sequence: one blind row
    mask[1, :, 0] = NEG_INF         # every head of the other: its first row
    mask[1, 0, 2, 1:] = NEG_INF     # a row that sees one key
    return sdpa_generator(mask, dtype=dtype)


@case(attention=True)
def sdpa_bool_N1LS_broadcast(dtype):
    return sdpa_generator(bool_mask(2, 1, 4, 4, seed=2, blind=[(1, 0, 3)]), dtype=dtype)


@case(attention=True)
def sdpa_bool_NHLS_whole_sequence_masked(dtype):
    allowed = torch.ones(2, 2, 4, 4, dtype=torch.bool)
    allowed[1] = False
    return sdpa_generator(allowed, dtype=dtype)


@case(attention=True, chunkable=True)
def sdpa_every_row_masked(dtype):
    return sdpa_generator(torch.zeros(4, 4, dtype=torch.bool), dtype=dtype)


@case(attention=True, dtypes=(F64, F32))
def sdpa_hf_min_masks_summing_to_neg_inf(dtype):
    """HF-style masks: a causal min-mask plus a padding min-mask; where both block, min + min = -inf."""
    low = torch.finfo(dtype).min
    causal = torch.full((4, 4), low, dtype=dtype).triu(1)
    key_ok = torch.tensor([[False, False, True, True], [True] * 4])             # left padding
    padding = torch.zeros(2, 1, 1, 4, dtype=dtype).masked_fill_(~key_ok[:, None, None, :], low)
    query_ok = torch.tensor([[True, False, True, True], [True] * 4])
    queries = torch.zeros(2, 1, 4, 1, dtype=dtype).masked_fill_(~query_ok[:, None, :, None], low)
    mask = causal + padding + queries  # rows mixing -inf and min; query 1 of sequence 0: all -inf
    return sdpa_generator(mask, dtype=dtype)


@case(attention=True, chunkable=True)
def sdpa_three_dims(dtype):
    return sdpa_generator(bool_mask(4, 5, seed=3, blind=[2]), N=None, H=3, S=5, dtype=dtype)


@case(attention=True)
def sdpa_gqa_bool_mask_and_scale(dtype):
    return sdpa_generator(bool_mask(4, 4, seed=4, blind=[0, 3]), H=4, kv_heads=2, scale=0.37, dtype=dtype)


@case(attention=True, chunkable=True)
def sdpa_causal_more_queries_than_keys(dtype):
    return sdpa_generator(L=6, S=3, is_causal=True, dtype=dtype)


@case(attention=True, chunkable=True)
def sdpa_causal_more_keys_than_queries(dtype):
    return sdpa_generator(L=3, S=6, is_causal=True, dtype=dtype)


@case(attention=True)
def sdpa_cross_attention_key_padding(dtype):
    key_ok = torch.tensor([[True, True, True, False, False, False], [False] * 6])  # one memory all padding
    return sdpa_generator(additive(key_ok[:, None, None, :], dtype), L=4, S=6, dtype=dtype)


@case(attention=True)
def sdpa_cross_attention_frozen_memory(dtype):
    key_ok = torch.tensor([[True, False, True, False, False], [False] * 5])
    return sdpa_generator(key_ok[:, None, None, :], S=5, frozen_kv=True, dtype=dtype)


@case(attention=True, random=True, dtypes=(F64, F32))
def sdpa_dropout_bool_mask(dtype):
    return sdpa_generator(bool_mask(2, 1, 4, 4, seed=5, blind=[(0, 0, 1), (1, 0, 3)]), dropout_p=0.3, dtype=dtype)


@case(attention=True)
def sdpa_mask_with_a_tangent(dtype):
    """A z-dependent additive bias plus key padding: the mask carries a tangent (math backend)."""
    Wq, Wk, Wv, Wb = (weight(3, 3, dtype=dtype, seed=s) for s in (1, 2, 3, 8))
    key_ok = torch.tensor([[True, True, False, False], [False] * 4])
    padding = additive(key_ok[:, None, None, :], dtype)

    def G(z):
        bias = torch.tanh((z @ Wb) @ z.mT)  # (N, H, L, L)
        return F.scaled_dot_product_attention(z @ Wq, z @ Wk, torch.sin(z @ Wv), attn_mask=bias + padding)

    return G, randn(2, 2, 4, 3, dtype=dtype, seed=6)


# Modules: nn.MultiheadAttention, nn.TransformerEncoderLayer / DecoderLayer, a GPT-style stack.

def seeded(build, seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


@case()
def mha_key_padding_whole_sequence(dtype):
    mha = seeded(lambda: nn.MultiheadAttention(8, 2, batch_first=True, dtype=dtype)).eval()
    padding = torch.tensor([[False, False, True, True, True], [True] * 5, [False] * 5])

    def G(z):
        return mha(z, z, z, key_padding_mask=padding, need_weights=False)[0]

    return G, randn(3, 5, 8, dtype=dtype, seed=1)


def encoder_case(train, dtype):
    layer = seeded(lambda: nn.TransformerEncoderLayer(8, 2, 16, 0.25, batch_first=True, dtype=dtype))
    layer.train(train)
    padding = torch.tensor([[False, False, False, True, True], [True] * 5, [False] * 5])
    return (lambda z: layer(z, src_key_padding_mask=padding)), randn(3, 5, 8, dtype=dtype, seed=1)


@case(dtypes=(F64, F32))
def encoder_layer_whole_sequence_padded(dtype):
    return encoder_case(False, dtype)


@case(random=True)
def encoder_layer_whole_sequence_padded_train(dtype):
    return encoder_case(True, dtype)


def decoder_case(train, dtype):
    layer = seeded(lambda: nn.TransformerDecoderLayer(8, 2, 16, 0.25, batch_first=True, dtype=dtype))
    layer.train(train)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)  # True = blocked, as the padding masks
    tgt_padding = torch.tensor([[True, True, False, False, False], [True] * 5])           # left padding
    memory_padding = torch.tensor([[False, False, False, True, True, True], [True] * 6])  # memory all padding
    Wm = weight(8, 8, dtype=dtype, seed=2)

    def G(z):
        memory = torch.tanh(torch.cat([z, z[:, :1]], dim=1) @ Wm)
        return layer(z, memory, tgt_mask=causal, tgt_key_padding_mask=tgt_padding,
                     memory_key_padding_mask=memory_padding, tgt_is_causal=True)

    return G, randn(2, 5, 8, dtype=dtype, seed=1)


@case()
def decoder_layer_padding_masks(dtype):
    return decoder_case(False, dtype)


@case(random=True)
def decoder_layer_padding_masks_train(dtype):
    return decoder_case(True, dtype)


def left_padded_mask(pads, T, kind, dtype):
    """The (N, 1, T, T) mask of causal attention over left-padded sequences, as a GPT-style model builds it."""
    key_ok = torch.stack([torch.arange(T) >= p for p in pads])  # the attention_mask: 0 on the left padding
    allowed = torch.ones(T, T, dtype=torch.bool).tril() & key_ok[:, None, None, :]
    if kind == "bool":
        return allowed
    if kind == "additive":
        return additive(allowed, dtype)
    low = torch.finfo(dtype).min  # HF's older style: finfo.min, not -inf; min + min overflows to -inf
    causal = torch.full((T, T), low, dtype=dtype).triu(1)
    return causal + torch.zeros(len(pads), 1, 1, T, dtype=dtype).masked_fill_(~key_ok[:, None, None, :], low)


def gpt_stack(pads, kind, dtype, *, T=6, C=8, H=2, layers=2, dropout=0.0):
    """Pre-LN decoder blocks on F.scaled_dot_product_attention, with causal + left padding."""
    mask = left_padded_mask(pads, T, kind, dtype)
    blocks = [[weight(*shape, dtype=dtype, seed=10 * layer + i) for i, shape in
               enumerate([(C, 3 * C), (C, C), (C, 2 * C), (2 * C, C)])] for layer in range(layers)]

    def G(x):
        N = x.shape[0]
        for Wqkv, Wo, W1, W2 in blocks:
            q, k, v = (F.layer_norm(x, (C,)) @ Wqkv).split(C, dim=-1)
            heads = lambda t: t.reshape(N, T, H, C // H).transpose(1, 2)  # noqa: E731
            a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask, dropout_p=dropout)
            x = x + a.transpose(1, 2).reshape(N, T, C) @ Wo
            x = x + F.gelu(F.layer_norm(x, (C,)) @ W1) @ W2
        return x

    return G, randn(len(pads), T, C, dtype=dtype, seed=1)


@case(dtypes=(F64, F32))
def gpt_stack_bool_mask_left_padding(dtype):
    return gpt_stack([2, 0, 6], "bool", dtype)  # the third sequence is all padding


@case()
def gpt_stack_additive_mask_left_padding(dtype):
    return gpt_stack([3, 0, 6], "additive", dtype)


@case(dtypes=(F64, F32))
def gpt_stack_hf_min_mask_left_padding(dtype):
    return gpt_stack([3, 0, 6], "min", dtype)


@case(random=True)
def gpt_stack_dropout_left_padding(dtype):
    return gpt_stack([2, 0, 6], "bool", dtype, dropout=0.2)


# ----------------------------------------------------------------------------------------------
# The checks: each returns (ours, reference); a verdict compares them
# ----------------------------------------------------------------------------------------------

def cubic(y, g):
    return ((y + g) ** 3).sum()


def linear(y, g):
    return (y * g).sum()


def seed_and(call, *args, **kwargs):
    torch.manual_seed(1)
    return call(*args, **kwargs)


def y_and_v(G, z, dtype):
    """y shared by every code (one output's shape, broadcast along dim 0), so f sums over codes."""
    torch.manual_seed(1)
    shape = G(z).shape[1:]
    return randn(*shape, dtype=dtype, seed=11), randn(*z.shape, dtype=dtype, seed=12)


def check_mixed_grad(c):
    G, z = c.build(c.dtype)
    y, v = y_and_v(G, z, c.dtype)
    return seed_and(mixedad.mixed_grad, cubic, G, z, y, v), seed_and(double_backward_mixed_grad, cubic, G, z, y, v)


def check_tangent(c):
    """J_G v, by mixed_grad with f linear in g; rows torch leaves at 0 must have a zero tangent."""
    G, z = c.build(c.dtype)
    y, v = y_and_v(G, z, c.dtype)
    y = y.expand(G(z).shape).clone()  # f linear in g: d/dy <v, J^T y> = J v, one y entry per output entry
    ours = seed_and(mixedad.mixed_grad, linear, G, z, y, v)
    if c.attention:
        out = seed_and(G, z)  # the user's kernel
        blind = (out == 0).all(dim=-1, keepdim=True).expand_as(ours)
        if not torch.equal(ours[blind], torch.zeros_like(ours[blind])):
            ours = ours.clone().fill_(float("nan"))  # a non-zero tangent on a row torch has at 0
    return ours, seed_and(double_backward_mixed_grad, linear, G, z, y, v)


def run_input_grad(make, c, chunk_size):
    G, z = c.build(c.dtype)
    y, _ = y_and_v(G, z, c.dtype)
    w = randn(*z.shape, dtype=c.dtype, seed=13)
    y = y.clone().requires_grad_()
    torch.manual_seed(1)
    dfdz = make(cubic, G, z, y, chunk_size=chunk_size)
    (dfdz * w).sum().backward()
    return dfdz.detach(), y.grad


def check_input_grad(c):
    return run_input_grad(mixedad.input_grad, c, None), run_input_grad(double_backward_input_grad, c, None)


def check_input_grad_chunked(c):
    return run_input_grad(mixedad.input_grad, c, 1), run_input_grad(double_backward_input_grad, c, 1)


def check_mixed_jacobian(c):
    G, z = c.build(c.dtype)
    y, _ = y_and_v(G, z, c.dtype)
    return (seed_and(mixedad.mixed_jacobian, cubic, G, z, y, chunk_size=16),
            seed_and(double_backward_mixed_jacobian, cubic, G, z, y))


CHECKS = {
    "mixed_grad": check_mixed_grad,
    "tangent": check_tangent,
    "input_grad": check_input_grad,
    "input_grad_chunked": check_input_grad_chunked,
    "mixed_jacobian": check_mixed_jacobian,
}


def applies(check, c):
    return check != "input_grad_chunked" or c.chunkable


def has_nan(tree):
    leaves = tree if isinstance(tree, (tuple, list)) else [tree]
    return any(bool(leaf.isnan().any()) for leaf in leaves)


def verdict(check, c):
    """("ok" | "NaN" | "inf" | "wrong" | "error: ...", max relative error)."""
    try:
        ours, expected = CHECKS[check](c)
    except Exception as error:  # noqa: BLE001  (the table records what happens)
        return f"error: {type(error).__name__}: {str(error).splitlines()[0][:80]}", float("nan")
    if has_nan(expected):
        return "reference NaN", float("nan")
    err = max_relative_error(ours, expected)
    if has_nan(ours):
        return "NaN", err
    leaves = ours if isinstance(ours, (tuple, list)) else [ours]
    if any(bool(leaf.isinf().any()) for leaf in leaves):
        return "inf", err
    return ("ok" if err <= RTOL[c.dtype] else "wrong"), err


PARAMS = [pytest.param(check, name, id=f"{name}-{check}") for name, c in CASES.items()
          for check in CHECKS if applies(check, c)]


@pytest.mark.parametrize("check, name", PARAMS)
def test_rows_that_see_no_key(check, name):
    c = CASES[name]
    ours, expected = CHECKS[check](c)
    assert not has_nan(expected), "the reference itself is not finite"
    assert not has_nan(ours), f"{name}: {check} has NaN"
    assert_close(ours, expected, rtol=RTOL[c.dtype], what=f"{name}: {check}")


@pytest.mark.parametrize("name", [name for name, c in CASES.items() if c.attention])
def test_output_rows_are_zero_where_torch_gives_zero(name):
    """The primal in mixedad's pass is torch's; rows that see no key are 0 there, with a 0 tangent."""
    from mixedad._frontend.tangents import push_tangent

    c = CASES[name]
    G, z = c.build(c.dtype)
    _, v = y_and_v(G, z, c.dtype)
    torch.manual_seed(1)
    (g,), (g_dot,), _ = push_tangent("mixed_grad(f, G, z, y)", G, [z], [v])
    torch.manual_seed(1)
    expected = G(z)
    assert_close(g, expected)  # bit for bit on the user's kernel; the math backend where rerouted
    blind = (expected == 0).all(dim=-1)
    assert not g_dot.isnan().any()
    assert torch.equal(g[blind], torch.zeros_like(g[blind]))
    assert torch.equal(g_dot[blind], torch.zeros_like(g_dot[blind]))


@pytest.mark.parametrize("name", [name for name, c in CASES.items() if c.attention])
def test_the_cases_have_rows_that_see_no_key(name):
    """The table means something: torch leaves rows at 0 in every attention case with a mask.

    is_causal is top-left aligned in PyTorch: query i sees keys 0..i, so every row sees key 0,
    with more queries than keys too; those cases check that no row is taken for blind.
    """
    c = CASES[name]
    G, z = c.build(c.dtype)
    torch.manual_seed(1)
    blind = (G(z) == 0).all(dim=-1)
    assert bool(blind.any()) != ("causal" in name), blind


# ----------------------------------------------------------------------------------------------
# The safe softmax, input_grad's choice of kernel, memory
# ----------------------------------------------------------------------------------------------

class Ops(TorchDispatchMode):
    """The aten ops run, and whether any of them produced a NaN."""

    def __init__(self):
        super().__init__()
        self.names, self.nan = set(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.add(func.__name__.split(".")[0])
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.device.type != "meta" \
                    and not leaf._is_zerotensor():  # forward AD's zero tangents hold no data
                self.nan |= bool(leaf.isnan().any())
        return out


@pytest.mark.parametrize("dtype", [F64, F32])
def test_probabilities_never_form_a_nan(dtype):
    """Rows of -inf give 0 without any intermediate NaN; rows mixing -inf and finfo.min are ordinary."""
    low = torch.finfo(dtype).min
    s = randn(2, 5, 4, dtype=dtype, seed=3)
    s[0, 1] = NEG_INF
    s[1, 2] = torch.tensor([low, NEG_INF, low, low])
    s[1, 3, 1:] = NEG_INF
    s[1, 4] = torch.tensor([low + low, NEG_INF, NEG_INF, NEG_INF])  # min + min = -inf
    expected = torch.softmax(s, dim=-1).nan_to_num_(0.0)
    with Ops() as ops:
        p = _attention._probabilities(s.clone(), masked=True)
    assert not ops.nan
    assert torch.equal(p[0, 1], torch.zeros(4, dtype=dtype)) and torch.equal(p[1, 4], torch.zeros(4, dtype=dtype))
    assert_close(p, expected, rtol=4 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("name", ["sdpa_bool_LS_all_false_row", "sdpa_hf_min_masks_summing_to_neg_inf",
                                  "gpt_stack_bool_mask_left_padding", "encoder_layer_whole_sequence_padded"])
def test_no_intermediate_nan_in_mixed_grad(name):
    c = CASES[name]
    G, z = c.build(c.dtype)
    y, v = y_and_v(G, z, c.dtype)
    with Ops() as ops:
        mixedad.mixed_grad(cubic, G, z, y, v)
    assert not ops.nan


def test_blockwise_tangent_without_host_synchronisation():
    """No data-dependent step: the tangent of a masked attention runs on meta tensors and fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for device, mode in [("meta", contextlib.nullcontext()), ("cpu", FakeTensorMode())]:
        with mode:
            q = torch.randn(2, 2, 8, 4, device=device)
            mask = torch.ones(8, 8, dtype=torch.bool, device=device)
            tangent = _attention.blockwise_tangent(q, q, q, q, q, q, q, attn_mask=mask)
        assert tangent.shape == q.shape


@pytest.mark.parametrize("kind", ["bool", "min"])
def test_fake_tensors_through_mixed_grad_and_input_grad(kind):
    """Shapes without data (FakeTensorMode): no step reads a mask's values, the min mask included."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        G, z = gpt_stack([3, 0, 6], kind, F64)
        y = torch.randn(6, 8, dtype=F64)
        assert mixedad.mixed_grad(cubic, G, z, y, z).shape == y.shape
        assert mixedad.input_grad(cubic, G, z, y).shape == z.shape


FAR = _attention.FAR_NEGATIVE


@pytest.mark.parametrize("mask, expected", [
    (None, False),
    (torch.tensor([[True, False], [False, False]]), False),                       # bool: -inf rows
    (torch.tensor([[0.0, NEG_INF], [NEG_INF, NEG_INF]]), False),                   # -inf rows: exact in both
    (torch.tensor([[0.0, -5e3], [-5e3, 0.0]]), False),                             # every row sees a key
    (torch.tensor([[0.0, -1.0], [-2.0, -3.0]]) * 100, False),                      # ALiBi-like: max 0 per row
    (torch.tensor([[0.0, NEG_INF], [-1e9, -1e9]]), True),                          # -1e9 masking
    (torch.tensor([[0.0, 1.0], [2 * FAR, NEG_INF]]), True),
    (torch.tensor([[0.0, -1e4], [-1e4, -1e4]], dtype=F32), True),                  # BERT's -10000
    (torch.full((3, 3), torch.finfo(F64).min, dtype=F64), True),                   # HF's finfo.min
    (torch.full((3, 3), -1e9, device="meta"), False),                              # no data to read
])
def test_which_masks_take_the_math_backend_in_input_grads_forward(mask, expected):
    assert _attention._rows_masked_by_large_numbers(mask) is expected


@pytest.mark.parametrize("kind, fused", [("bool", True), ("additive", True), ("min", False)])
def test_input_grad_forward_kernel(kind, fused):
    """The user's fused kernel, except for rows masked only by large numbers, where its backward is inexact."""
    G, z = gpt_stack([3, 0, 6], kind, F64)
    y, _ = y_and_v(G, z, F64)
    with Ops() as ops:
        mixedad.input_grad(cubic, G, z, y)
    assert ("_scaled_dot_product_flash_attention_for_cpu" in ops.names) is fused
    assert ("_safe_softmax" in ops.names) is not fused


def masked_rows_generator(T, kind="bool"):
    """Bare attention over two sequences, one left padded by T/4, one all padding; the mask is built beforehand."""
    key_ok = torch.stack([torch.arange(T) >= T // 4, torch.zeros(T, dtype=torch.bool)])
    mask = torch.ones(T, T, dtype=torch.bool).tril() & key_ok[:, None, None, :]
    mask = mask if kind == "bool" else additive(mask, F32)
    Wqkv = weight(32, 96, dtype=F32, seed=1)

    def G(x):
        q, k, v = (t.unflatten(-1, (2, 16)).transpose(1, 2) for t in (x @ Wqkv).split(32, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(-2)

    return G


@pytest.mark.parametrize("kind", ["additive", "bool"])
def test_peak_with_rows_that_see_no_key_grows_at_most_linearly(kind):
    """Exact byte counts: mixed_grad's peak, from T = 512 to T = 2048, at most 4x, not 16x.

    With a bool mask PyTorch's CPU kernel turns the mask into a float one of T x T, so G's own
    forward is quadratic; mixedad's blocks read the bool mask as it is, and its peak stays below
    that forward's. With an additive mask G's forward is linear in T too.
    """
    peaks = []
    for T in (512, 2048):
        G = masked_rows_generator(T, kind)
        z, y, v = (randn(2, T, 32, dtype=F32, seed=s) for s in (1, 2, 3))
        ours, forward = cpu_peak_memory(mixedad.mixed_grad, cubic, G, z, y, v)[1], cpu_peak_memory(G, z)[1]
        print(f"{kind} T={T}: mixed_grad {ours} B, forward {forward} B")
        if kind == "additive":
            assert forward <= 4.0 * T * 2 * 32 * 4 * 4, forward  # a few (2, T, 32) tensors, no T x T
        elif T == 2048:
            assert ours < forward
        peaks.append(ours)
    assert peaks[1] <= 4.0 * peaks[0], peaks


# ----------------------------------------------------------------------------------------------
# Hugging Face transformers (optional): tiny GPT-2 and Mistral, sdpa attention, left padding
# ----------------------------------------------------------------------------------------------

def hf_model(kind):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=11, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, **common)
        model_class = transformers.GPT2Model
    else:
        config = transformers.MistralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                            sliding_window=None, **common)
        model_class = transformers.MistralModel
    return seeded(lambda: model_class(config)).to(F64).eval()


@pytest.mark.parametrize("kind", ["gpt2", "mistral"])
def test_transformers_left_padded_batch(kind):
    model = hf_model(kind)
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]])

    def G(inputs_embeds):
        return model(inputs_embeds=inputs_embeds, attention_mask=attention_mask).last_hidden_state

    z = randn(3, 6, 16, seed=1)
    y, v = y_and_v(G, z, F64)
    ours = mixedad.mixed_grad(cubic, G, z, y, v)
    assert not ours.isnan().any()
    assert_close(ours, double_backward_mixed_grad(cubic, G, z, y, v))

    def input_grad_and_its_backward(make):
        y_ = y.clone().requires_grad_()
        dfdz = make(cubic, G, z, y_)
        (dfdz * v).sum().backward()
        return dfdz.detach(), y_.grad

    ours = input_grad_and_its_backward(mixedad.input_grad)
    assert not has_nan(ours)
    assert_close(ours, input_grad_and_its_backward(double_backward_input_grad))


if __name__ == "__main__":
    for name, c in CASES.items():
        for check in CHECKS:
            if applies(check, c):
                what, err = verdict(check, c)
                print(f"{name:55s} {check:20s} {what:12s} {err:.1e}", flush=True)
