"""Many tangents at once (mixedad._frontend.batched): mixed_jacobian and vmap over mixed_grad on the per-op rules.

Each generator below is one that the rules exist for (custom Functions without jvp, the cdist
quantiser, GroupNorm on channels_last, nn.MultiheadAttention, causal SDPA). For each, in float64
against double backward: exact, one batched pass (never one pass per tangent, never the whole-G
fallback, whose warning the suite turns into an error), the same paths in the report as without
vmap, and peak memory (exact byte counts) flat in depth.
"""
import warnings

import pytest
import torch
from torch import nn

import mixedad
import mixedad.mixed
from mixedad import zoo
from mixedad.profiling import peak_memory
from mixedad.reference import double_backward_mixed_grad, double_backward_mixed_jacobian
from mixedad.testing import assert_close

from tests.op_rule_generators import build as build_op_rule_generator
from tests.op_rule_generators import cubic

F64, F32 = torch.float64, torch.float32


class MultiheadAttentionStack(nn.Module):
    """``depth`` causal nn.MultiheadAttention layers with residuals, on a (B, T, E) sequence."""

    def __init__(self, depth, d_model=8, nhead=2, tokens=6):
        super().__init__()
        self.tokens = tokens
        self.layers = nn.ModuleList(nn.MultiheadAttention(d_model, nhead, batch_first=True) for _ in range(depth))
        self.register_buffer("mask", torch.ones(tokens, tokens, dtype=torch.bool).triu(1))

    def forward(self, x):
        for attention in self.layers:
            x = x + attention(x, x, x, attn_mask=self.mask, need_weights=False)[0]
        return x


def _sequence_problem(G, tokens, d_model, dtype):
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(1, tokens, d_model, generator=gen, dtype=dtype)
    with torch.no_grad():
        y = torch.randn(G(z).shape, generator=gen, dtype=dtype)
    return G, z, y


def build(name, depth, dtype):
    """``(G, z, y)`` for one of :data:`NAMES` with ``depth`` layers or blocks."""
    if name == "multihead_attention":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            G = MultiheadAttentionStack(depth).to(dtype).eval()
        return _sequence_problem(G, 6, 8, dtype)
    if name == "causal_sdpa":
        return _sequence_problem(zoo.attention_stack(8, nhead=2, layers=depth, dtype=dtype), 6, 8, dtype)
    G, z, y, _ = build_op_rule_generator(name, depth, dtype)
    return G, z, y


NAMES = ["stylegan2_ada", "vq_decoder", "group_norm_channels_last", "multihead_attention", "causal_sdpa"]
#: The op each generator is here for, and the path it must take in a batched pass.
AWKWARD = {
    "stylegan2_ada": ("_BiasAct (custom Function)", "local double-VJP"),
    "vq_decoder": ("torch.functional.cdist", "written formula"),
    "group_norm_channels_last": ("torch.nn.functional.group_norm", "written formula"),
    "multihead_attention": ("torch.nn.functional.scaled_dot_product_attention", "blockwise attention"),
    "causal_sdpa": ("torch.nn.functional.scaled_dot_product_attention", "blockwise attention"),
}


def tangents(z, k=8, seed=3):
    return torch.randn(k, *z.shape, generator=torch.Generator().manual_seed(seed), dtype=z.dtype)


@pytest.fixture
def batched_only(monkeypatch):
    """Fail if mixed_grad or mixed_jacobian pushes a tangent on its own instead of in one batched pass."""

    def one_tangent(*args, **kwargs):
        raise AssertionError("pushed one tangent per pass instead of one batched pass")

    monkeypatch.setattr(mixedad.mixed, "push_tangent", one_tangent)


@pytest.mark.parametrize("name", NAMES)
def test_mixed_jacobian_is_exact_in_one_batched_pass_per_chunk(name, batched_only):
    G, z, y = build(name, 2, F64)
    ours = mixedad.mixed_jacobian(cubic, G, z, y, chunk_size=8)
    assert_close(ours, double_backward_mixed_jacobian(cubic, G, z, y), rtol=1e-9)


@pytest.mark.parametrize("name", NAMES)
def test_vmap_over_mixed_grad_is_exact_in_one_batched_pass(name, batched_only):
    G, z, y = build(name, 2, F64)
    vs = tangents(z)
    ours = torch.func.vmap(lambda v: mixedad.mixed_grad(cubic, G, z, y, v))(vs)
    assert_close(ours, torch.stack([double_backward_mixed_grad(cubic, G, z, y, v) for v in vs]), rtol=1e-9)


@pytest.mark.parametrize("name", NAMES)
def test_tangent_report_under_vmap_shows_the_same_paths(name):
    G, z, _ = build(name, 2, F64)
    vs = tangents(z, k=3)
    seen = {}

    def report(v):
        seen["report"] = mixedad.tangent_report(G, z, v)
        return v

    torch.func.vmap(report)(vs)
    plain = mixedad.tangent_report(G, z, vs[0])
    under_vmap = seen["report"]
    assert [row[:3] for row in under_vmap.rows] == [row[:3] for row in plain.rows], str(under_vmap)
    assert under_vmap.rows == plain.rows  # one batched pass: the calls are counted once, as in one pass
    op, path = AWKWARD[name]
    assert op in under_vmap.ops(path), str(under_vmap)
    assert under_vmap.flat


def _peak(run, name, depth):
    G, z, y = build(name, depth, F32)
    return peak_memory(run, G, z, y)[1]


def _jacobian(G, z, y):
    return mixedad.mixed_jacobian(cubic, G, z, y, chunk_size=8)


def _vmapped(G, z, y):
    return torch.func.vmap(lambda v: mixedad.mixed_grad(cubic, G, z, y, v))(tangents(z))


@pytest.mark.parametrize("run", [_jacobian, _vmapped], ids=["mixed_jacobian", "vmap"])
@pytest.mark.parametrize("name", NAMES)
def test_peak_flat_in_depth_with_eight_tangents(name, run):
    """Exact byte counts: depth 24 within 1.3x of depth 4 (the whole-G fallback would grow ~6x)."""
    shallow, deep = _peak(run, name, 4), _peak(run, name, 24)
    assert deep <= 1.3 * shallow, (shallow, deep)


def test_attention_peak_linear_in_length_with_eight_tangents():
    """Two causal attention layers, 8 tangents: T = 2048 over T = 512 within 5x (T x T would be 16x)."""
    G = zoo.attention_stack(64, nhead=4, layers=2)
    peaks = {}
    for length in (512, 2048):
        gen = torch.Generator().manual_seed(length)
        z, y = torch.randn(1, length, 64, generator=gen), torch.randn(1, length, 64, generator=gen)
        peaks[length] = peak_memory(_vmapped, G, z, y)[1]
    assert peaks[2048] <= 5 * peaks[512], peaks


def test_a_tangent_batch_of_one_and_of_many_agree():
    G, z, y = build("stylegan2_ada", 1, F64)
    vs = tangents(z, k=5)
    many = torch.func.vmap(lambda v: mixedad.mixed_grad(cubic, G, z, y, v))(vs)
    one = torch.func.vmap(lambda v: mixedad.mixed_grad(cubic, G, z, y, v))(vs[:1])
    assert_close(one[0], many[0], rtol=1e-12)


def test_vmap_over_codes_and_tangents_is_torch_funcs_and_exact():
    """A vmap that batches z too is not a batch of tangents: torch.func's formulas, still exact."""
    G = zoo.mlp(2, 6, seed=0, dtype=F64)
    zs, vs = torch.randn(3, 4, 6, dtype=F64), torch.randn(3, 4, 6, dtype=F64)
    y = torch.randn(4, 6, dtype=F64)
    ours = torch.func.vmap(lambda z, v: mixedad.mixed_grad(cubic, G, z, y, v))(zs, vs)
    assert_close(ours, torch.stack([double_backward_mixed_grad(cubic, G, z, y, v) for z, v in zip(zs, vs)]))


def test_g_closing_over_a_tensor_the_users_vmap_batches_is_exact():
    """The primal then differs across the batch: mixedad's batch steps aside for torch.func's pass."""
    G = zoo.mlp(2, 6, seed=0, dtype=F64)
    z, y = torch.randn(4, 6, dtype=F64), torch.randn(4, 6, dtype=F64)
    scales, vs = torch.rand(3, dtype=F64) + 0.5, torch.randn(3, 4, 6, dtype=F64)
    ours = torch.func.vmap(lambda s, v: mixedad.mixed_grad(cubic, lambda x: G(x) * s, z, y, v))(scales, vs)
    expected = [double_backward_mixed_grad(cubic, lambda x, s=s: G(x) * s, z, y, v) for s, v in zip(scales, vs)]
    assert_close(ours, torch.stack(expected))


def test_what_a_batch_cannot_take_goes_one_tangent_per_pass_and_stays_exact():
    """Train-mode BatchNorm updates its running statistics in place: mixed_jacobian pushes row by row."""
    G = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh()).to(F64).train()
    z, y = torch.randn(5, 3, dtype=F64), torch.randn(5, 4, dtype=F64)
    before = G[1].running_mean.clone()
    ours = mixedad.mixed_jacobian(cubic, G, z, y, chunk_size=4)
    after = G[1].running_mean.clone()
    G[1].running_mean.copy_(before)
    G[1].num_batches_tracked.zero_()
    assert_close(ours, double_backward_mixed_jacobian(cubic, G, z, y))
    assert torch.equal(after, G[1].running_mean)  # updated once, as by one forward pass


def test_nothing_of_the_batch_is_left_behind():
    from mixedad._hooks.functorch import current_level

    G, z, y = build("stylegan2_ada", 1, F64)
    mixedad.mixed_jacobian(cubic, G, z, y, chunk_size=8)
    assert current_level() is None
    assert torch.is_grad_enabled() and not torch.autograd.forward_ad._current_level >= 0
    assert torch.autograd.Function.apply.__code__ is torch.autograd.Function.__dict__["apply"].__func__.__code__


# Found by a review as a new user: what torch.func's own pass (a vmap that the batch steps aside
# for) must refuse rather than compute wrongly, and state a failed batch must not leave behind.

W = torch.randn(4, 4, generator=torch.Generator().manual_seed(7), dtype=F64)


def _f(y, g):
    return ((g * y) ** 2).sum()


def _hooked_if_requires_grad(x):
    h = x @ W
    if h.requires_grad:
        h.register_hook(lambda g: g * 3.0)
    return h.tanh()


def _scaled_by_grad_fn(x):
    h = x @ W
    return h.tanh() * (2.0 if h.grad_fn is not None else 1.0)


class _ClippedBackward(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.sin()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g.clamp(-0.1, 0.1) * x.cos()

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return t * x.cos()


class _WrongJvp(_ClippedBackward):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 2.0 * t * x.cos()


@pytest.mark.parametrize("G, reason", [
    (_hooked_if_requires_grad, "gradient hook"),
    (_scaled_by_grad_fn, "grad_fn"),
    (lambda x: _ClippedBackward.apply(x @ W).tanh(), "not linear"),
], ids=["hook if requires_grad", "branch on grad_fn", "clipping backward with jvp"])
def test_what_only_reverse_mode_gives_is_refused_under_vmap_and_exact_in_mixed_jacobian(G, reason):
    z, y = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    with pytest.raises(mixedad.op_rules.UnderTransformError, match=reason):
        torch.func.vmap(lambda v: mixedad.mixed_grad(_f, G, z, y, v))(torch.randn(2, 3, 4, dtype=F64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the whole-G fallback, row by row
        ours = mixedad.mixed_jacobian(_f, G, z, y)
    assert_close(ours, double_backward_mixed_jacobian(_f, G, z, y), rtol=1e-10)


def test_a_jvp_that_disagrees_with_the_backward_is_refused_under_vmap_over_codes():
    G = lambda x: _WrongJvp.apply(x @ W).tanh()  # noqa: E731
    zs, vs, y = torch.randn(2, 3, 4, dtype=F64), torch.randn(2, 3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    with pytest.raises(mixedad.op_rules.UnderTransformError, match="jvp disagrees with the backward"):
        torch.func.vmap(lambda z, v: mixedad.mixed_grad(_f, G, z, y, v))(zs, vs)


class _Ema(nn.Module):
    """Updates an EMA of its activations in place under no_grad (a VQ codebook, a running mean)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4).to(F64)
        self.register_buffer("average", torch.zeros(4, dtype=F64))

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        with torch.no_grad():
            self.average.mul_(0.9).add_(0.1 * h.mean(0))
        return h


def test_an_in_place_update_under_no_grad_is_refused_by_name_under_vmap_and_replayed_once_in_mixed_jacobian():
    G, z, y = _Ema(), torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    with pytest.raises(mixedad.op_rules.UnderTransformError, match="writes in place into a tensor from outside"):
        torch.func.vmap(lambda v: mixedad.mixed_grad(_f, G, z, y, v))(torch.randn(2, 3, 4, dtype=F64))
    assert torch.equal(G.average, torch.zeros(4, dtype=F64))
    ours = mixedad.mixed_jacobian(_f, G, z, y)
    after = G.average.clone()
    G.average.zero_()
    assert_close(ours, double_backward_mixed_jacobian(_f, G, z, y), rtol=1e-10)
    assert torch.equal(after, G.average)  # updated once, as by one forward pass


def test_a_failed_vmap_leaves_no_failure_behind():
    """A random op in the caller's vmap with randomness='error' fails: that is the transform's, not the formula's."""
    mixedad.op_rules.forget_failures()
    G = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3), nn.Tanh()).to(F64).train()
    z, y = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    with pytest.raises(RuntimeError):
        torch.func.vmap(lambda v: mixedad.mixed_grad(_f, G, z, y, v))(torch.randn(2, 3, 4, dtype=F64))
    from mixedad.op_rules._local import FAILED
    assert not FAILED
    torch.manual_seed(0)
    ours = mixedad.mixed_jacobian(_f, G, z, y)
    torch.manual_seed(0)
    assert_close(ours, double_backward_mixed_jacobian(_f, G, z, y), rtol=1e-10)


def test_tangent_report_under_a_vmap_the_batch_steps_aside_for_lists_torch_funcs_paths():
    G = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3), nn.Tanh()).to(F64).train()
    seen = {}

    def report(v):
        seen["report"] = mixedad.tangent_report(G, torch.randn(3, 4, dtype=F64), v)
        return v

    torch.func.vmap(report, randomness="same")(torch.randn(2, 3, 4, dtype=F64))
    assert "torch.nn.functional.dropout" in seen["report"].ops("forward AD"), str(seen["report"])


def test_an_empty_z_has_an_empty_jacobian():
    G, z, y = mixedad.zoo.mlp(2, 4, dtype=F64), torch.randn(0, 4, dtype=F64), torch.randn(0, 4, dtype=F64)
    assert mixedad.mixed_jacobian(_f, G, z, y).shape == (0, 4, 0, 4)
    assert double_backward_mixed_jacobian(_f, G, z, y).shape == (0, 4, 0, 4)
