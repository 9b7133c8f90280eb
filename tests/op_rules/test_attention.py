"""The attention rule: exact against double backward (math backend) and linear in T in memory."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixedad
from mixedad.op_rules import _attention
from mixedad.profiling import peak_memory
from mixedad.reference import double_backward_input_grad, double_backward_mixed_grad
from mixedad.testing import assert_close

F64 = torch.float64
SDPA = "torch.nn.functional.scaled_dot_product_attention"
gen = torch.Generator().manual_seed(0)


def cubic(y, g):
    return ((y + g) ** 3).sum()


def randn(*shape):
    return torch.randn(*shape, generator=gen, dtype=F64)


Q = randn(2, 3, 7, 5)
K_MEMORY, V_MEMORY = randn(2, 3, 11, 5), randn(2, 3, 11, 4)
BOOL_MASK = torch.rand(7, 7, generator=gen) > 0.4
BOOL_MASK[:, 0] = True  # no row fully masked
ADDITIVE_MASK = randn(3, 1, 7)

# name: G(z) with z of Q's shape
CASES = {
    "plain": lambda z: F.scaled_dot_product_attention(z, z * 2, z.sin()),
    "causal": lambda z: F.scaled_dot_product_attention(z, z * 2, z.sin(), is_causal=True),
    "bool_mask": lambda z: F.scaled_dot_product_attention(z, z * 2, z.sin(), attn_mask=BOOL_MASK),
    "additive_mask_scale": lambda z: F.scaled_dot_product_attention(z, z * 2, z.sin(), attn_mask=ADDITIVE_MASK,
                                                                    scale=0.3),
    "gqa": lambda z: F.scaled_dot_product_attention(z, z[:, :1] * 2, z[:, :1].cos(), enable_gqa=True),
    "cross_attention_frozen_memory": lambda z: F.scaled_dot_product_attention(z, K_MEMORY, V_MEMORY),
    "query_frozen": lambda z: F.scaled_dot_product_attention(Q, randn_like_k(z), z.tanh()),
    "longer_queries_causal": lambda z: F.scaled_dot_product_attention(
        torch.cat([z, z.flip(-2)], dim=-2), z * 2, z.sin(), is_causal=True),
    "longer_keys_causal": lambda z: F.scaled_dot_product_attention(
        z, torch.cat([z, z * 3], dim=-2), torch.cat([z, z], dim=-2).sin(), is_causal=True),
    "three_dims": lambda z: F.scaled_dot_product_attention(z[0], z[1] * 2, z[0].sin()),
}


def randn_like_k(z):
    return z.flip(-1) * 2


@pytest.mark.parametrize("block_bytes", [None, 200])  # one block, and many blocks of a few rows
@pytest.mark.parametrize("name", CASES)
def test_sdpa_matches_double_backward(name, block_bytes, monkeypatch):
    if block_bytes is not None:
        monkeypatch.setattr(_attention, "BLOCK_BYTES", block_bytes)
    G = CASES[name]
    z, v = Q.clone(), randn(*Q.shape)
    y = randn(*G(z).shape)
    ours = mixedad.mixed_grad(cubic, G, z, y, v, strategy="forward")
    assert_close(ours, double_backward_mixed_grad(cubic, G, z, y, v))
    assert mixedad.tangent_report(G, z, v).ops("blockwise attention") == [SDPA]


def transformer_layer():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.TransformerEncoderLayer(16, 4, 32, 0.0, batch_first=True).to(F64).eval()


def multihead():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(16, 4, batch_first=True).to(F64).eval()
    return lambda z: mha(z, z * 2, z.sin(), need_weights=False)[0]


@pytest.mark.parametrize("make", [transformer_layer, multihead], ids=["TransformerEncoderLayer", "MultiheadAttention"])
def test_modules_reach_the_rule_through_their_inner_calls(make):
    """F.multi_head_attention_forward's inner SDPA and projections are reached, not let through."""
    G = make()
    z, v = randn(2, 6, 16), randn(2, 6, 16)
    y = randn(2, 6, 16)
    assert_close(mixedad.mixed_grad(cubic, G, z, y, v), double_backward_mixed_grad(cubic, G, z, y, v))
    report = mixedad.tangent_report(G, z, v)
    assert report.ops("blockwise attention") == [SDPA]
    assert "torch.nn.functional.linear" in report.ops("frozen layer")  # in_proj and out_proj


def test_dropout_in_train_mode_draws_the_masks_double_backward_draws():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 4, 32, 0.3, batch_first=True).to(F64).train()
    z, y, v = randn(2, 6, 16), randn(2, 6, 16), randn(2, 6, 16)
    torch.manual_seed(1)
    ours = mixedad.mixed_grad(cubic, layer, z, y, v)
    after = torch.get_rng_state()
    torch.manual_seed(1)
    assert_close(ours, double_backward_mixed_grad(cubic, layer, z, y, v))
    assert torch.equal(after, torch.get_rng_state())
    torch.manual_seed(1)
    report = mixedad.tangent_report(layer, z, v)
    assert ("torch.nn.functional.scaled_dot_product_attention", "forward AD", "dropout: math backend", 1) in report.rows


def test_functional_dropout_and_input_grad_replay_the_same_masks():
    G = lambda z: F.scaled_dot_product_attention(z, z * 2, z.sin(), dropout_p=0.4)  # noqa: E731
    z, y = Q.clone(), randn(*Q.shape)
    torch.manual_seed(2)
    ours = mixedad.mixed_grad(cubic, G, z, y)
    torch.manual_seed(2)
    assert_close(ours, double_backward_mixed_grad(cubic, G, z, y))
    w = randn(*Q.shape)

    def run(make):
        y_ = y[:1].clone().requires_grad_()
        torch.manual_seed(3)
        (make(cubic, G, z, y_, chunk_size=1) * w).sum().backward()
        return y_.grad

    assert_close(run(mixedad.input_grad), run(double_backward_input_grad))


def test_input_grad_forward_uses_the_fused_kernel():
    """Without dropout, input_grad's forward pass runs the user's fused SDPA kernel, not the math backend."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    G = mixedad.zoo.attention_stack(16, nhead=2, dtype=F64)
    z, y = torch.randn(1, 12, 16, dtype=F64), torch.randn(1, 12, 16, dtype=F64, requires_grad=True)
    with Ops() as ops:
        dfdz = mixedad.input_grad(cubic, G, z, y)
    assert "_scaled_dot_product_flash_attention_for_cpu" in ops.names
    assert "_softmax" not in ops.names  # the math backend's softmax over T x T
    y_ref = y.detach().clone().requires_grad_()
    assert_close(dfdz, double_backward_input_grad(cubic, G, z, y_ref))


def peak_at_length(G, T, *paths_skipped):
    """mixed_grad's exact peak on a sequence of length T (d_model 32), optionally without some paths."""
    from mixedad.op_rules import skipping

    z, y, v = (torch.randn(1, T, 32) for _ in range(3))
    with skipping(*paths_skipped):
        return peak_memory(mixedad.mixed_grad, cubic, G, z, y, v)[1]


def encoder_layers():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(*[nn.TransformerEncoderLayer(32, 2, 64, 0.0, batch_first=True) for _ in range(2)]).eval()


@pytest.mark.parametrize("make", [lambda: mixedad.zoo.attention_stack(32, nhead=2), encoder_layers],
                         ids=["attention_stack", "TransformerEncoderLayer"])
def test_peak_grows_at_most_linearly_in_sequence_length(make):
    """Exact byte counts: from T = 512 to T = 2048 at most 4x, not 16x; inside encoder layers too."""
    G = make()
    small, large = peak_at_length(G, 512), peak_at_length(G, 2048)
    print(f"peak T=512 {small} B, T=2048 {large} B, ratio {large / small:.2f}")
    assert large <= 4.0 * small, (small, large)


def test_math_path_would_be_quadratic():
    """The comparison is meaningful: without the rule the same G's peak grows about 16x."""
    from mixedad.op_rules._dispatch import ATTENTION

    G = mixedad.zoo.attention_stack(32, nhead=2)
    small, large = peak_at_length(G, 256, ATTENTION), peak_at_length(G, 1024, ATTENTION)
    print(f"math path: peak T=256 {small} B, T=1024 {large} B, ratio {large / small:.2f}")
    assert large > 8 * small


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_fused_primal_and_blockwise_tangent(dtype):
    G = mixedad.zoo.attention_stack(64, nhead=4, dtype=dtype, device="cuda")
    z, y, v = (torch.randn(2, 256, 64, dtype=dtype, device="cuda") for _ in range(3))
    ours = mixedad.mixed_grad(cubic, G, z, y, v, strategy="forward")
    expected = double_backward_mixed_grad(cubic, G.float(), z.float(), y.float(), v.float())
    assert_close(ours.float(), expected, rtol=1e-2 if dtype == torch.float16 else 1e-3)


@pytest.mark.parametrize("case", ["plain", "causal", "bool mask", "additive mask", "gqa", "cross lengths",
                                  "frozen keys"])
@pytest.mark.parametrize("block_bytes", [None, 2048])
def test_a_batch_of_tangents_equals_one_tangent_at_a_time(case, block_bytes):
    """blockwise_tangent with a leading tangent dimension: P once per block, the same numbers as a loop."""
    gen = torch.Generator().manual_seed(0)
    heads_kv = 1 if case == "gqa" else 2
    lk = 5 if case == "cross lengths" else 7

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rand(2, 2, 7, 4), rand(2, heads_kv, lk, 4), rand(2, heads_kv, lk, 3)
    dq, dk, dv = rand(3, 2, 2, 7, 4), rand(3, 2, heads_kv, lk, 4), rand(3, 2, heads_kv, lk, 3)
    if case == "frozen keys":
        dk = dv = None
    kwargs = {"is_causal": case == "causal", "enable_gqa": case == "gqa", "block_bytes": block_bytes}
    if case == "bool mask":
        kwargs["attn_mask"] = torch.rand(7, lk, generator=gen) > 0.3
    if case == "additive mask":
        kwargs["attn_mask"] = rand(2, 1, 7, lk)
    sdpa_kwargs = {key: value for key, value in kwargs.items() if key != "block_bytes"}
    out = F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)
    batched = _attention.blockwise_tangent(q, k, v, out, dq, dk, dv, batched=True, **kwargs)
    loop = torch.stack([_attention.blockwise_tangent(q, k, v, out, dq[i], None if dk is None else dk[i],
                                                     None if dv is None else dv[i], **kwargs) for i in range(3)])
    assert batched.shape == (3, *out.shape)
    assert_close(batched, loop, rtol=1e-12)


def _spy_primals(monkeypatch):
    """Records, for each call of the attention rule's blocks, whether they computed the primal themselves."""
    taken = []
    real = _attention.blockwise_attention

    def spy(*args, **kwargs):
        taken.append(kwargs.get("out") is None)
        return real(*args, **kwargs)

    monkeypatch.setattr(_attention, "blockwise_attention", spy)
    return taken


OWN_PRIMAL_CASES = {
    "causal": {"is_causal": True},
    "additive mask": {"attn_mask": randn(7, 7)},
    "bool mask": {"attn_mask": BOOL_MASK},
    "rows that see no key": {"attn_mask": torch.zeros(7, 7, dtype=F64).index_fill_(0, torch.tensor([0, 4]),
                                                                                  float("-inf"))},
    "rows masked by finfo.min": {"attn_mask": torch.zeros(7, 7, dtype=F64).index_fill_(0, torch.tensor([2]),
                                                                                      torch.finfo(F64).min)},
    "scale": {"scale": 0.3, "is_causal": True},
    "gqa": {"enable_gqa": True},
}


@pytest.mark.parametrize("case", sorted(OWN_PRIMAL_CASES))
def test_on_the_cpu_the_primal_comes_from_the_tangents_blocks(case, monkeypatch):
    """On the CPU the rule computes the primal in the blocks of its tangent (one softmax per block for both):
    the primal is SDPA's output to round-off, and the answer is double backward's, rows that see no key and rows
    masked only by finfo.min (where the fused kernels' backward is inexact) included."""
    taken = _spy_primals(monkeypatch)
    kwargs = OWN_PRIMAL_CASES[case]
    keys = (lambda z: z[:, :1]) if case == "gqa" else (lambda z: z)
    G = lambda z: F.scaled_dot_product_attention(z, keys(z) * 2, keys(z).sin(), **kwargs)  # noqa: E731
    z, v = Q.clone(), randn(*Q.shape)
    y = randn(*Q.shape)
    ours = mixedad.mixed_grad(cubic, G, z, y, v, strategy="forward")
    assert taken == [True]
    expected = double_backward_mixed_grad(cubic, G, z, y, v)
    assert_close(ours, expected, rtol=1e-10)
    from mixedad._frontend.tangents import push_tangent

    (primal,), _, _ = push_tangent("test", G, (z,), (v,))
    assert_close(primal, G(z), rtol=1e-13)
    if case == "rows that see no key":
        assert ours[..., [0, 4], :].abs().max() < 1e-12 < ours.abs().max()  # as double backward: 0 there


@pytest.mark.parametrize("lengths", [(3, 0), (0, 3)])
def test_no_keys_or_no_queries(lengths):
    """Found by a review: a sequence of zero keys (or queries) runs, as in plain autograd."""
    lq, lk = lengths
    q, memory = randn(1, 2, lq, 4), randn(1, 2, lk, 4)
    G = lambda z: F.scaled_dot_product_attention(z, memory + 0 * z.sum(), memory.sin())  # noqa: E731
    y = randn(1, 2, lq, 4)
    v = randn(*q.shape)
    assert_close(mixedad.mixed_grad(cubic, G, q, y, v), double_backward_mixed_grad(cubic, G, q, y, v))


def test_under_cpu_autocast_the_primal_is_the_users_call(monkeypatch):
    """SDPA picks its dtype under autocast (bfloat16 here): the rule must not compute the primal in float32 in its
    own blocks, as it does elsewhere on the CPU."""
    taken = _spy_primals(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 16, generator=gen) * 0.3

    def G(x):
        q, k, v = (x @ w.T).view(1, 32, 3, 2, 8).permute(2, 0, 3, 1, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    z = torch.randn(1, 32, 16, generator=gen)
    with torch.no_grad():
        plain = G(z)
    from mixedad._frontend.tangents import push_tangent

    g, _, _ = push_tangent("test", G, (z,), (torch.ones_like(z),))
    assert taken == [False]
    assert g[0].dtype == plain.dtype == torch.bfloat16 and torch.equal(g[0], plain)


@pytest.mark.parametrize("present", ["qkv", "kv", "qv", "qk", "q", "k", "v"])
@pytest.mark.parametrize("own_primal", [True, False])
def test_any_set_of_tangents_against_forward_ad_and_inputs_left_alone(present, own_primal):
    """Found in review: with Q alone and no tangent of it, the scaled Q was a view of the caller's Q and was
    scaled in place. Every subset of tangents: the math backend's forward AD to round-off, inputs untouched."""
    q, k, v = randn(2, 3, 7, 5), randn(2, 3, 6, 5), randn(2, 3, 6, 4)
    tangents = {name: randn(*t.shape) if name in present else None for name, t in zip("qkv", (q, k, v))}
    before = [t.clone() for t in (q, k, v, *[t for t in tangents.values() if t is not None])]
    from mixedad._hooks.attention_backends import math_backend

    with math_backend():
        expected_out, expected = torch.func.jvp(F.scaled_dot_product_attention, (q, k, v), tuple(
            torch.zeros_like(p) if t is None else t for p, t in zip((q, k, v), tangents.values())))
    out = None if own_primal else expected_out.clone()
    got_out, got = _attention.blockwise_attention(q, k, v, *tangents.values(), out=out, block_bytes=300)
    assert_close(got_out, expected_out, rtol=1e-13)
    assert_close(got, expected, rtol=1e-12)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v, *[t for t in tangents.values() if t is not None])))


def _broadcast_keys_generator(batch=3, heads=2, lq=4, lk=5, e=4):
    """Per-sample queries, keys and values shared by the batch (3-d k and v broadcast over 4-d q)."""
    wq, wkv = randn(batch * heads * lq * e, 6) * 0.3, randn(2 * heads * lk * e, 6) * 0.3

    def G(z):
        q = torch.tanh(wq @ z).view(batch, heads, lq, e)
        k, v = torch.tanh(wkv @ z).view(2, heads, lk, e)
        return F.scaled_dot_product_attention(q, k, v)

    return G


def test_a_batch_of_tangents_with_keys_of_fewer_dims_than_the_queries():
    """Found in review: a batch of k tangents of 3-d keys beside 4-d queries lined k up with the batch dim, silently
    when k equalled the batch (1.27 off under vmap, 0.86 in mixed_jacobian), an error otherwise."""
    from mixedad.reference import double_backward_mixed_jacobian

    G = _broadcast_keys_generator()
    z, y = randn(6), randn(3, 2, 4, 4)
    tangents = randn(3, 6)  # as many tangents as batch entries
    ours = torch.func.vmap(lambda v: mixedad.mixed_grad(cubic, G, z, y, v))(tangents)
    assert_close(ours, torch.stack([double_backward_mixed_grad(cubic, G, z, y, v) for v in tangents]))
    expected = double_backward_mixed_jacobian(cubic, G, z, y)
    for chunk in (None, 3, 4):
        assert_close(mixedad.mixed_jacobian(cubic, G, z, y, chunk_size=chunk), expected)


def _heads(t):  # (2, 6, 32) -> (2, 4, 6, 8): heads from the channels, as attention layers do
    return t.view(2, 6, 4, 8).transpose(1, 2)


LAYOUT_CASES = {  # (q, k, v) from three (2, 6, 32) projections
    "4-d, the CPU's flash kernel": lambda q, k, v: (_heads(q), _heads(k), _heads(v)),
    "3-d": lambda q, k, v: (q, k, v),
    "5-d": lambda q, k, v: tuple(t.view(2, 6, 2, 2, 8).permute(0, 2, 3, 1, 4) for t in (q, k, v)),
    "keys of fewer dims": lambda q, k, v: (_heads(q), _heads(k)[0], _heads(v)[0]),
    "value head dim differs": lambda q, k, v: (_heads(q), _heads(k), _heads(v)[..., :5]),
}
@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_g_sees_the_layout_of_a_plain_forward(case):
    """Found in review: the primal took q's layout where SDPA's math path gives a contiguous output, so a view after
    attention that works in a plain forward failed under mixed_grad. Primal and tangent take SDPA's layout (the
    strides a plain forward gives: a view that works there works here)."""
    w = randn(96, 8) * 0.3

    def attend(x):
        return F.scaled_dot_product_attention(*LAYOUT_CASES[case](*(x @ w.T).split(32, dim=-1)))

    def G(x):
        out = attend(x)
        return out.reshape(out.shape[0], -1)

    z, v = randn(2, 6, 8), randn(2, 6, 8)
    with torch.no_grad():
        plain = attend(z)
    from mixedad._frontend.tangents import push_tangent

    seen = []
    (primal,), _, _ = push_tangent("test", lambda x: seen.append(attend(x)) or G(x), (z,), (v,))
    assert seen[0].stride() == plain.stride() and seen[0].shape == plain.shape
    y = randn(*G(z).shape)
    assert_close(mixedad.mixed_grad(cubic, G, z, y, v), double_backward_mixed_grad(cubic, G, z, y, v))


REFUSED = {
    "value longer than key": lambda q: F.scaled_dot_product_attention(q[0], q[0], torch.cat([q[0], q[0]], dim=-2)),
    "mask beside is_causal": lambda q: F.scaled_dot_product_attention(q[0], q[0], q[0], is_causal=True,  # (3-d)
                                                                      attn_mask=torch.ones(5, 5, dtype=torch.bool)),
    "gqa on 2-d inputs": lambda q: F.scaled_dot_product_attention(q[0, 0], q[0, 0], q[0, 0], enable_gqa=True),
    "mask that does not broadcast": lambda q: F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 5, 5) > 0),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_inputs_sdpa_refuses_raise_its_own_error(case):
    """Found in review: the blocks accepted what SDPA refuses (a value longer than the key was cut to the key's
    length, a mask beside is_causal applied both). Such calls go to the user's own SDPA, which raises. (3-d inputs:
    the CPU's flash kernel, which 4-d ones reach, accepts the first two.)"""
    G = REFUSED[case]
    z = randn(1, 2, 5, 4)
    with pytest.raises((RuntimeError, IndexError)) as plain:
        G(z)
    with pytest.raises((RuntimeError, IndexError)) as ours:
        mixedad.mixed_grad(cubic, G, z, randn(1, 2, 5, 4), randn(1, 2, 5, 4))
    assert type(ours.value) is type(plain.value) and str(ours.value) == str(plain.value)


def test_unbatched_and_grouped_heads_of_their_own():
    """Found in review: 2-d query, key and value (no batch dims) crashed the blocks; GQA where key and value have
    different head counts repeated the value by the key's ratio."""
    w = randn(4 * 6, 4) * 0.3

    def unbatched(z):
        return F.scaled_dot_product_attention(*(torch.tanh(z @ w[i * 4:(i + 1) * 4].T) for i in range(3)))

    def grouped(z):  # 6 query heads, 2 key heads, 3 value heads
        x = z @ w.T  # (5, 24)
        q = x.view(5, 6, 4).transpose(0, 1)
        k, v = x[:, :8].reshape(5, 2, 4).transpose(0, 1), x[:, 8:20].reshape(5, 3, 4).transpose(0, 1)
        return F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True)

    for G in (unbatched, grouped):
        z, v = randn(5, 4), randn(5, 4)
        y = randn(*G(z).shape)
        assert_close(mixedad.mixed_grad(cubic, G, z, y, v), double_backward_mixed_grad(cubic, G, z, y, v))


def test_a_plan_of_a_mask_held_outside_g():
    """Found in review: a CPU plan of attention with a bool mask G reads from outside (not a buffer) failed on meta."""
    mask = torch.rand(8, 8, generator=gen) > 0.3
    mask[:, 0] = True
    w = randn(48, 16) * 0.3

    def G(z):
        q, k, v = (z @ w.T).view(1, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    z, y = randn(1, 8, 16), randn(1, 2, 8, 8)
    planned = mixedad.profiling.plan(cubic, G, z, y, device="cpu", methods="mixed_grad").peaks["mixed_grad"]
    measured = peak_memory(mixedad.mixed_grad, cubic, G, z, y)[1]
    assert abs(planned - measured) <= 0.02 * measured, (planned, measured)


def test_attention_blocks_sets_the_block_size_for_this_thread_and_the_plan():
    """Smaller blocks: the same numbers, a smaller peak (planned alike), and the default back after the block."""
    from mixedad.profiling import plan

    G = mixedad.zoo.attention_stack(16, nhead=2, layers=1, dtype=F64)
    z, y, v = (randn(1, 96, 16) for _ in range(3))
    whole, whole_peak = peak_memory(mixedad.mixed_grad, cubic, G, z, y, v)  # 1.5 MiB: one block of 96 queries
    with mixedad.op_rules.attention_blocks(16 * 96 * 8):  # 8 queries a block
        blocks, blocks_peak = peak_memory(mixedad.mixed_grad, cubic, G, z, y, v)
        planned = plan(cubic, G, z, y, device="cpu", methods=("mixed_grad",)).peaks["mixed_grad"]
    assert_close(blocks, whole, rtol=1e-12)
    assert blocks_peak < whole_peak and blocks_peak <= planned <= 1.1 * blocks_peak  # a plan runs two blocks: high
    assert peak_memory(mixedad.mixed_grad, cubic, G, z, y, v)[1] == whole_peak
    with pytest.raises(RuntimeError, match="inside"), mixedad.op_rules.attention_blocks(4096):
        raise RuntimeError("inside")
    assert peak_memory(mixedad.mixed_grad, cubic, G, z, y, v)[1] == whole_peak
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="attention_blocks"), mixedad.op_rules.attention_blocks(bad):
            pass
