"""Seams: situations at the edges of "reverse mode is the meaning", as data.

Every case is a small builder that returns G, f, z, y, v (float64, tiny) and an expected
verdict:

- ``"exact"``: mixedad's answer equals a double backward written by hand in this file
  (``torch.autograd.grad(torch.autograd.grad(f(y, G(z)), z, create_graph=True)[0], y, v)``
  under the math SDPA backend with the MHA fast path off), relative error < 1e-9;
- ``"refused"``: mixedad raises an error of its own (the message opens with the call, e.g.
  ``mixed_grad(f, G, z, y)``) that matches the case's regex. Expected only where double backward
  itself fails, or where no exact answer exists at flat memory.

After every case, whatever the verdict, nothing may have leaked: TorchFunctionMode and
TorchDispatchMode stack depths, grad mode, inference mode, the forward-AD level (-1), forward
grad mode, the functorch level, the MHA fast-path flag, the SDPA backend flags, the user's
requires_grad flags and ``.grad`` fields, module training flags, instance attributes and hooks,
buffers, a set of torch attributes (``Function.apply``'s code object included), and the CPU RNG
state, which must equal what one plain forward of G leaves (per chunk for ``input_grad``).

The ground truth here deliberately does not use ``mixedad.reference``.

``python -m tests.test_seams`` prints a table of the verdicts now.
"""
import concurrent.futures
import io
import re
import types

import pytest
import torch
import torch._dynamo  # noqa: F401  (importing it replaces torch.manual_seed: do that before any snapshot)
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad
from torch.autograd.function import Function, once_differentiable
from torch.utils._pytree import tree_leaves, tree_map

import mixedad

from tests.seams_common import (attributes as _attributes, math_attention, outer_loss, check as _check,
                                run_recording, truth_or_error, verdict,
                                cases_with_open_marked, print_table,
                                truth_input_grad, truth_mixed_grad)

DT = torch.float64
RTOL = 1e-9
OWN_ERROR = re.compile(r"^\s*(mixed_grad|input_grad|mixed_jacobian|spot_check|tangent_report)\(")


# ----------------------------------------------------------------------------------------------
# The case table
# ----------------------------------------------------------------------------------------------

CASES = []


def case(area, expect="exact", match=None, call="mixed_grad", random=False, stateful=False, chunk=2):
    """Register a builder. ``expect`` is "exact", "refused" or "exact|refused" (either is honest)."""

    def register(build):
        CASES.append(types.SimpleNamespace(area=area, name=build.__name__, build=build, expect=expect,
                                           match=match, call=call, random=random, stateful=stateful,
                                           chunk=chunk))
        return build

    return register


def rand(*shape, scale=1.0):
    return torch.randn(*shape, dtype=DT) * scale


def mat(n_in, n_out):
    return torch.randn(n_in, n_out, dtype=DT) / n_in ** 0.5 * 1.5


def f_generic(y, g):
    """A per-code sum: y (8,) meets each floating leaf of g along its last dim, non-linearly."""
    total = y.new_zeros(())
    for leaf in tree_leaves(g):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            continue
        w = y[: leaf.shape[-1]] if leaf.dim() else y[0]
        total = total + (torch.sin(leaf * w) + leaf.pow(2) * torch.cos(w) + leaf.pow(3) * w).sum()
    return total


def problem(G, z, *, y=None, v=None, f=f_generic, **extra):
    y = rand(8) if y is None else y
    v = rand(*z.shape) if v is None else v
    return types.SimpleNamespace(G=G, f=f, z=z, y=y, v=v, **extra)


def mlp_parts(d_in=5, d_hidden=6, d_out=4):
    return mat(d_in, d_hidden), mat(d_hidden, d_hidden), mat(d_hidden, d_out)


# ----------------------------------------------------------------------------------------------
# Area 1: attention masks
# ----------------------------------------------------------------------------------------------

def _qkv(z, S, Wq, Wk, Wv):
    """q from z's L positions; k, v from S positions built from z (cycled when S > L)."""
    L = z.shape[-2]
    src = torch.cat([z, z.flip(-2), z], dim=-2)[..., :S, :] if S != L else z
    return z @ Wq, src @ Wk, src @ Wv


def sdpa_problem(mask=None, *, N=2, H=2, L=4, S=4, E=3, is_causal=False, gqa=None, scale=None, dropout_p=0.0):
    Wq, Wk, Wv, Wo = mat(E, E), mat(E, E), mat(E, E), mat(E, E)

    def G(z):
        q, k, v = _qkv(z, S, Wq, Wk, Wv)
        kwargs = {}
        if gqa is not None:
            k, v = k[:, :gqa], v[:, :gqa]
            kwargs["enable_gqa"] = True
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                             dropout_p=dropout_p, **kwargs)
        return torch.tanh(out @ Wo) + q

    return problem(G, rand(N, H, L, E))


@case("attention")
def sdpa_bool_LS_all_false_row():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    return sdpa_problem(mask)


@case("attention")
def sdpa_additive_LS_all_neg_inf_row():
    mask = rand(4, 4)
    mask[2] = float("-inf")
    mask[0, 3] = float("-inf")
    return sdpa_problem(mask)


@case("attention")
def sdpa_bool_N1LS_broadcast():
    mask = torch.rand(2, 1, 4, 4) > 0.4
    mask[:, :, :, 0] = True
    mask[1, 0, 3] = False  # one all-False row in one sequence
    return sdpa_problem(mask)


@case("attention")
def sdpa_additive_NHLS():
    return sdpa_problem(rand(2, 2, 4, 4))


@case("attention")
def sdpa_bool_NHLS_whole_sequence_masked():
    mask = torch.ones(2, 2, 4, 4, dtype=torch.bool)
    mask[1] = False  # every row of the second sequence sees no key
    return sdpa_problem(mask)


@case("attention")
def sdpa_is_causal_L_greater_than_S():
    return sdpa_problem(L=5, S=3, is_causal=True)


@case("attention")
def sdpa_is_causal_L_less_than_S():
    return sdpa_problem(L=3, S=5, is_causal=True)


@case("attention")
def sdpa_gqa_4_heads_over_2():
    return sdpa_problem(N=2, H=4, gqa=2)


@case("attention")
def sdpa_gqa_with_bool_mask_and_scale():
    mask = torch.rand(4, 4) > 0.3
    mask[1] = False
    return sdpa_problem(mask, N=1, H=4, gqa=2, scale=0.37)


@case("attention")
def sdpa_additive_mask_depending_on_z():
    Wq, Wk, Wv, Wm = mat(3, 3), mat(3, 3), mat(3, 3), mat(3, 3)

    def G(z):
        q, k, v = z @ Wq, z @ Wk, z @ Wv
        bias = torch.tanh((z @ Wm) @ z.transpose(-1, -2))  # (N, H, L, L): the mask carries a tangent
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    return problem(G, rand(2, 2, 4, 3))


def mha(embed=4, heads=2, batch_first=True):
    return nn.MultiheadAttention(embed, heads, batch_first=batch_first, dtype=DT).eval()


@case("attention")
def mha_key_padding_whole_sequence():
    m = mha()
    kpm = torch.zeros(3, 4, dtype=torch.bool)
    kpm[1] = True  # the second sequence is padding throughout
    kpm[2, 2:] = True

    return problem(lambda z: m(z, z, z, key_padding_mask=kpm, need_weights=False)[0], rand(3, 4, 4), modules=[m])


@case("attention")
def mha_key_padding_partial_need_weights():
    m = mha()
    kpm = torch.zeros(3, 4, dtype=torch.bool)
    kpm[0, 3] = True
    kpm[2, 1:] = True

    def G(z):
        out, weights = m(z, z, z, key_padding_mask=kpm)  # need_weights=True: explicit softmax path
        return out, weights

    return problem(G, rand(3, 4, 4), modules=[m])


@case("attention")
def mha_float_key_padding_and_bool_attn_mask_seq_first():
    m = mha(batch_first=False)
    kpm = torch.zeros(2, 4, dtype=DT)
    kpm[1, 0] = float("-inf")
    attn = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)  # True = blocked
    return problem(lambda z: m(z, z, z, key_padding_mask=kpm, attn_mask=attn, need_weights=False)[0],
                   rand(4, 2, 4), modules=[m])


@case("attention")
def mha_3d_float_attn_mask_per_head():
    m = mha()
    mask = rand(3 * 2, 4, 5)
    mask[1, 2] = float("-inf")  # one head, one query: no visible key
    kv = rand(3, 5, 4)
    return problem(lambda z: m(z, kv + z.mean(1, keepdim=True), kv, attn_mask=mask, need_weights=False)[0],
                   rand(3, 4, 4), modules=[m])


def encoder_layer():
    return nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0, batch_first=True, dtype=DT).eval()


@case("attention")
def encoder_layer_src_key_padding_partial():
    layer = encoder_layer()
    kpm = torch.tensor([[False, False, False, True], [False, True, True, True], [False] * 4])
    return problem(lambda z: layer(z, src_key_padding_mask=kpm), rand(3, 4, 4), modules=[layer])


@case("attention")
def encoder_layer_src_key_padding_whole_sequence():
    layer = encoder_layer()
    kpm = torch.tensor([[False, False, True, True], [True] * 4, [False] * 4])
    return problem(lambda z: layer(z, src_key_padding_mask=kpm), rand(3, 4, 4), modules=[layer])


@case("attention")
def encoder_layer_causal_mask_and_padding():
    layer = encoder_layer()
    causal = nn.Transformer.generate_square_subsequent_mask(4, dtype=DT)
    kpm = torch.tensor([[True, False, False, False], [False] * 4])  # left padding on the first
    return problem(lambda z: layer(z, src_mask=causal, src_key_padding_mask=kpm, is_causal=True),
                   rand(2, 4, 4), modules=[layer])


@case("attention")
def decoder_layer_memory_masks():
    layer = nn.TransformerDecoderLayer(4, 2, dim_feedforward=8, dropout=0.0, batch_first=True, dtype=DT).eval()
    Wm = mat(4, 4)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(4, dtype=DT)
    memory_mask = torch.zeros(4, 5, dtype=torch.bool)
    memory_mask[1] = True  # bool memory mask: True = blocked; row 1 sees no memory
    mkpm = torch.tensor([[False, False, False, True, True], [False] * 5])

    def G(z):
        memory = torch.tanh(torch.cat([z, z[:, :1]], dim=1) @ Wm)
        return layer(z, memory, tgt_mask=tgt_mask, memory_mask=memory_mask, memory_key_padding_mask=mkpm,
                     tgt_is_causal=True)

    return problem(G, rand(2, 4, 4), modules=[layer])


def gpt_block_problem(pads):
    C, H, T = 4, 2, 5
    Wqkv, Wo, W1, W2 = mat(C, 3 * C), mat(C, C), mat(C, 8), mat(8, C)
    N = len(pads)
    key_ok = torch.stack([torch.arange(T) >= p for p in pads])                 # left padding
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & key_ok[:, None, None, :]  # (N,1,T,T)

    def G(x):
        q, k, v = (x @ Wqkv).split(C, dim=-1)
        heads = lambda t: t.reshape(N, T, H, C // H).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask)
        x = x + a.transpose(1, 2).reshape(N, T, C) @ Wo
        x = F.layer_norm(x, (C,))
        return x + F.gelu(x @ W1) @ W2

    return problem(G, rand(N, T, C))


@case("attention")
def gpt_block_causal_left_padding():
    return gpt_block_problem([2, 0, 4])


@case("attention")
def gpt_block_fully_padded_sequence():
    return gpt_block_problem([5, 1])


@case("attention")
def sdpa_additive_large_negative_row():
    mask = rand(4, 4)
    mask[1] = -1e9  # finite: the row is a uniform softmax, not a masked row
    return sdpa_problem(mask)


@case("attention", random=True)
def sdpa_dropout_with_bool_mask():
    mask = torch.rand(4, 4) > 0.3
    mask[:, 0] = True
    return sdpa_problem(mask, dropout_p=0.25)


@case("attention")
def sdpa_frozen_kv_all_false_row():
    Wq = mat(3, 3)
    k, v = rand(2, 2, 5, 3), rand(2, 2, 5, 3)   # constants: only q carries a tangent
    mask = torch.rand(4, 5) > 0.5
    mask[3] = False

    return problem(lambda z: F.scaled_dot_product_attention(z @ Wq, k, v, attn_mask=mask) + z, rand(2, 2, 4, 3))


@case("attention")
def sdpa_inside_no_grad_region():
    Wq, Wk = mat(3, 3), mat(3, 3)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()

    def G(z):
        q = torch.tanh(z @ Wq)
        with torch.no_grad():
            a = F.scaled_dot_product_attention(q, z @ Wk, z, attn_mask=mask)  # a constant
        return q * a + q

    return problem(G, rand(2, 2, 4, 3))


@case("attention")
def sdpa_single_query_decode_step():
    Wq, Wk, Wv = mat(3, 3), mat(3, 3), mat(3, 3)
    mask = torch.tensor([[True, True, False, True, False, False]])
    cache = rand(2, 2, 5, 3)

    def G(z):  # z: (N, H, 1, E), one new token against a cache of 5 plus itself
        src = torch.cat([cache, z], dim=-2)
        return F.scaled_dot_product_attention(z @ Wq, src @ Wk, src @ Wv, attn_mask=mask)

    return problem(G, rand(2, 2, 1, 3))


@case("attention")
def mha_kdim_vdim_per_head_weights():
    m = nn.MultiheadAttention(4, 2, kdim=3, vdim=5, batch_first=True, dtype=DT).eval()
    kpm = torch.tensor([[False, False, True], [False, True, True]])
    Wk, Wv = mat(4, 3), mat(4, 5)

    def G(z):
        out, w = m(z, z[:, :3] @ Wk, z[:, :3] @ Wv, key_padding_mask=kpm, average_attn_weights=False)
        return out, w

    return problem(G, rand(2, 4, 4), modules=[m])


# ----------------------------------------------------------------------------------------------
# Area 2: custom autograd.Functions with odd backwards
# ----------------------------------------------------------------------------------------------

class ClipGrad(Function):
    """Identity forward; backward clips the incoming gradient (not linear in it)."""

    @staticmethod
    def forward(x, c):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.c = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g.clamp(-ctx.c, ctx.c), None


class NormGrad(Function):
    """Identity forward; backward normalises the incoming gradient."""

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g / g.norm()


class ReverseGrad(Function):
    """Gradient reversal: identity forward, -g backward (linear)."""

    @staticmethod
    def forward(x):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return -g


class BadJvpSin(Function):
    """sin, with a jvp 1.5 times what its backward says."""

    @staticmethod
    def forward(x):
        return x.sin()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.x = inputs[0]

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()

    @staticmethod
    def jvp(ctx, t):
        return 1.5 * ctx.x.cos() * t


class GoodJvpSin(Function):
    @staticmethod
    def forward(x):
        return x.sin()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.x = inputs[0]

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()

    @staticmethod
    def jvp(ctx, t):
        return ctx.x.cos() * t


class InplaceDouble(Function):
    """x.mul_(2) in place, ctx.mark_dirty, no jvp."""

    @staticmethod
    def forward(x):
        return x.mul_(2)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_dirty(inputs[0])

    @staticmethod
    def backward(ctx, g):
        return g * 2


class InplaceDoubleJvp(InplaceDouble):
    @staticmethod
    def jvp(ctx, t):
        return t.mul_(2)


class OldStyleExp(Function):
    """forward(ctx, ...) without setup_context, no jvp."""

    @staticmethod
    def forward(ctx, x):
        out = x.exp()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * out


class OldStyleExpJvp(Function):
    @staticmethod
    def forward(ctx, x):
        out = x.exp()
        ctx.save_for_backward(out)
        ctx.out = out
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * out

    @staticmethod
    def jvp(ctx, t):
        return t * ctx.out


class SinAndSign(Function):
    """Two outputs, the second non-differentiable."""

    @staticmethod
    def forward(x):
        return x.sin(), (x > 0).to(x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g, g_sign):
        (x,) = ctx.saved_tensors
        return g * x.cos()


class PolyWithOptions(Function):
    """Non-tensor arguments: a float, a string and a tuple."""

    @staticmethod
    def forward(x, scale, kind, powers):
        return scale * (x ** powers[0] if kind == "pow" else x.sin())

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.scale, ctx.kind, ctx.powers = inputs
        ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        p = ctx.powers[0]
        return g * ctx.scale * p * x ** (p - 1), None, None, None


class SquareCtxAttribute(Function):
    """Saves its input as a ctx attribute, not with save_for_backward."""

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.x = inputs[0]

    @staticmethod
    def backward(ctx, g):
        return 2 * ctx.x * g


class SquareSaved(Function):
    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class OnceDiffTanh(Function):
    @staticmethod
    def forward(x):
        return x.tanh()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * (1 - out * out)


class OnceDiffTanhJvp(OnceDiffTanh):
    @staticmethod
    def jvp(ctx, t):
        return t * (1 - ctx.out_for_jvp ** 2)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.out_for_jvp = output


class ExpSavedOutput(Function):
    @staticmethod
    def forward(x):
        return x.exp()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * out


class MulNoneForSecond(Function):
    """x * w whose backward returns None for w: w is a constant for reverse mode."""

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g * w, None


class SelfGradInForward(Function):
    """Forward computes sin(2x) as the gradient of sin(x)^2, with enable_grad and autograd.grad inside."""

    @staticmethod
    def forward(x):
        with torch.enable_grad():
            t = x.detach().requires_grad_()
            (gx,) = torch.autograd.grad(t.sin().pow(2).sum(), t)
        return gx.detach()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2 * torch.cos(2 * x)


class NoGradInsideForwardJvp(Function):
    """Forward runs under torch.no_grad() (harmless in a Function); a correct jvp."""

    @staticmethod
    def forward(x):
        with torch.no_grad():
            return x.sin() * 1.0

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.x = inputs[0]

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()

    @staticmethod
    def jvp(ctx, t):
        return ctx.x.cos() * t


def function_problem(apply, *, z_shape=(4, 5)):
    W1, W2, W3 = mlp_parts()

    def G(z):
        h = torch.tanh(z @ W1)
        h = apply(h @ W2)
        return torch.tanh(h) @ W3 + h[..., :4]

    return problem(G, rand(*z_shape))


# A backward that is not linear in its incoming gradient has no flat-memory tangent: "auto" may
# answer exactly through a reverse pass (with a warning) or refuse; "forward" must refuse.
@case("custom Function", expect="exact|refused", match=r"ClipGrad")
def fn_clip_gradient():
    return function_problem(lambda h: ClipGrad.apply(h, 0.05))


@case("custom Function", expect="refused", match=r"ClipGrad")
def fn_clip_gradient_strategy_forward():
    p = fn_clip_gradient()
    p.run = lambda: mixedad.mixed_grad(p.f, p.G, p.z, p.y, p.v, strategy="forward")
    return p


@case("custom Function", expect="exact|refused", match=r"NormGrad")
def fn_normalise_gradient():
    return function_problem(NormGrad.apply)


@case("custom Function")
def fn_gradient_reversal():
    return function_problem(ReverseGrad.apply)


@case("custom Function")
def fn_jvp_disagrees_with_backward():
    return function_problem(BadJvpSin.apply)


@case("custom Function")
def fn_correct_jvp():
    return function_problem(GoodJvpSin.apply)


@case("custom Function")
def fn_inplace_mark_dirty_no_jvp():
    return function_problem(lambda h: InplaceDouble.apply(h * 1.0))


@case("custom Function")
def fn_inplace_mark_dirty_with_jvp():
    return function_problem(lambda h: InplaceDoubleJvp.apply(h * 1.0))


@case("custom Function")
def fn_old_style_no_setup_context():
    return function_problem(OldStyleExp.apply)


@case("custom Function")
def fn_old_style_with_jvp():
    return function_problem(OldStyleExpJvp.apply)


@case("custom Function")
def fn_non_differentiable_second_output():
    def apply(h):
        s, sign = SinAndSign.apply(h)
        return s * sign + s

    return function_problem(apply)


@case("custom Function")
def fn_non_tensor_arguments():
    return function_problem(lambda h: PolyWithOptions.apply(h, 0.7, "pow", (3,)))


@case("custom Function")
def fn_input_saved_as_ctx_attribute():
    return function_problem(SquareCtxAttribute.apply)


@case("custom Function")
def fn_input_saved_with_save_for_backward():
    return function_problem(SquareSaved.apply)


@case("custom Function", expect="refused", match=r"OnceDiffTanh")
def fn_once_differentiable_no_jvp():
    return function_problem(OnceDiffTanh.apply)


@case("custom Function", expect="refused|answered", match=r"OnceDiffTanhJvp|once_differentiable")
# Double backward raises; the Function's own jvp passes the dot-product test against its
# backward, so mixedad may answer with it (the true derivative) instead of refusing.
def fn_once_differentiable_with_jvp():
    return function_problem(OnceDiffTanhJvp.apply)


@case("custom Function")
def fn_backward_uses_saved_output():
    return function_problem(ExpSavedOutput.apply)


@case("custom Function")
def fn_backward_returns_none_for_differentiable_input():
    return function_problem(lambda h: MulNoneForSecond.apply(h, h.cos()))


@case("custom Function")
def fn_grad_mode_toggled_in_forward():
    return function_problem(SelfGradInForward.apply)


@case("custom Function")
def fn_no_grad_in_forward_with_jvp():
    return function_problem(NoGradInsideForwardJvp.apply)


class DetachingBackward(Function):
    """A backward computed under no_grad: double backward sees no path through it."""

    @staticmethod
    def forward(x):
        return 2 * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        with torch.no_grad():
            return g * 2


class AffineBackward(Function):
    """A backward affine (not linear) in the incoming gradient: g + 0.1."""

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g + 0.1


class MulNeedsInputGrad(Function):
    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return (g * w if ctx.needs_input_grad[0] else None), (g * x if ctx.needs_input_grad[1] else None)


class ReturnsInputAsIs(Function):
    @staticmethod
    def forward(x):
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return 3 * g


class OuterCallsInner(Function):
    """Forward calls another custom Function; its own backward, no jvp."""

    @staticmethod
    def forward(x):
        return 2 * GoodJvpSin.apply(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * g * x.cos()


class DropoutFn(Function):
    """Old style, draws a random mask in forward, no jvp."""

    @staticmethod
    def forward(ctx, x):
        mask = (torch.rand_like(x) > 0.3).to(x.dtype) / 0.7
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * mask


@case("custom Function", expect="refused", match=r"DetachingBackward|detach")
def fn_backward_detaches_under_no_grad():
    return function_problem(DetachingBackward.apply)


@case("custom Function")
def fn_backward_affine_in_gradient():
    return function_problem(AffineBackward.apply)


@case("custom Function")
def fn_needs_input_grad_with_constant_weight():
    w = rand(6)
    return function_problem(lambda h: MulNeedsInputGrad.apply(h, w))


@case("custom Function")
def fn_returns_input_as_is():
    return function_problem(lambda h: ReturnsInputAsIs.apply(h * 1.0))


@case("custom Function")
def fn_forward_calls_another_function():
    return function_problem(OuterCallsInner.apply)


@case("custom Function")
def fn_bad_jvp_inside_no_grad_region():
    def apply(h):
        with torch.no_grad():
            c = BadJvpSin.apply(h)
        return h * c + GoodJvpSin.apply(h)

    return function_problem(apply)


@case("custom Function", random=True)
def fn_dropout_inside_function_forward():
    return function_problem(DropoutFn.apply)


# ----------------------------------------------------------------------------------------------
# Area 3: grad-mode tricks inside G
# ----------------------------------------------------------------------------------------------

def region_problem(region, **extra):
    """G = h * c(h) + h^2 (+ d(h)), where ``region`` computes c (and maybe d) under some grad-mode trick."""
    W1, W2, W3 = mat(5, 4), mat(4, 4), mat(4, 4)

    def G(z):
        h = torch.tanh(z @ W1)
        c, d = region(h, W2, W3)
        return h * c + h.pow(2) + d

    return problem(G, rand(4, 5), **extra)


@case("grad mode")
def grad_with_no_grad():
    def region(h, W2, W3):
        with torch.no_grad():
            c = (h @ W2).sin()
        return c, 0.0

    return region_problem(region)


@case("grad mode")
def grad_no_grad_decorator():
    @torch.no_grad()
    def constant(h, W2):
        return (h @ W2).sin()

    return region_problem(lambda h, W2, W3: (constant(h, W2), 0.0))


@case("grad mode")
def grad_with_set_grad_enabled_false():
    def region(h, W2, W3):
        with torch.set_grad_enabled(False):
            c = (h @ W2).sin()
        return c, 0.0

    return region_problem(region)


@case("grad mode")
def grad_plain_set_grad_enabled_calls():
    def region(h, W2, W3):
        torch.set_grad_enabled(False)
        c = (h @ W2).sin()
        torch.set_grad_enabled(True)
        return c, 0.0

    return region_problem(region)


@case("grad mode")
def grad_C_set_grad_enabled():
    def region(h, W2, W3):
        torch._C._set_grad_enabled(False)
        c = (h @ W2).sin()
        torch._C._set_grad_enabled(True)
        return c, 0.0

    return region_problem(region)


@case("grad mode")
def grad_enable_grad_inside_no_grad():
    def region(h, W2, W3):
        with torch.no_grad():
            c = (h @ W2).sin()
            with torch.enable_grad():
                d = (h @ W3).cos()  # differentiable again
            c = c + d  # back in no_grad: constant
        return c, d

    return region_problem(region)


@case("grad mode")
def grad_no_grad_inside_enable_grad():
    def region(h, W2, W3):
        with torch.enable_grad():
            d = (h @ W3).cos()
            with torch.no_grad():
                c = (h @ W2).sin() + d
        return c, d

    return region_problem(region)


@case("grad mode")
def grad_set_grad_enabled_true_inside_no_grad():
    def region(h, W2, W3):
        with torch.no_grad():
            c = (h @ W2).sin()
            with torch.set_grad_enabled(True):
                d = (h @ W3).cos()
        return c, d

    return region_problem(region)


@case("grad mode")
def grad_inference_mode_inside_G():
    def region(h, W2, W3):
        with torch.inference_mode():
            c = (h @ W2).sin()
        return c.clone(), 0.0

    return region_problem(region)


# Literal double backward fails here (f runs with grad off); either the numbers of G's computation
# or a clear error is honest. A silent other number is not.
@case("grad mode", expect="exact|refused", match=r"grad mode|grad_mode|set_grad_enabled")
def grad_G_leaves_grad_mode_off():
    W1, W2 = mat(5, 4), mat(4, 4)

    def G(z):
        out = torch.tanh(z @ W1) @ W2
        torch.set_grad_enabled(False)  # never turned back on: a bug in G, seen after it returns
        return out

    def G_truth(z):
        try:
            return G(z)
        finally:
            torch.set_grad_enabled(True)

    return problem(G, rand(4, 5), truth_G=G_truth)


@case("grad mode")
def grad_tensor_hook_negates():
    W1, W2 = mat(5, 4), mat(4, 4)

    def G(z):
        h = torch.tanh(z @ W1)
        h.register_hook(lambda g: -g)  # a user who knows G is always differentiated
        return torch.tanh(h @ W2) + h

    return problem(G, rand(4, 5))


@case("grad mode", expect="exact|refused", match=r"hook")
def grad_tensor_hook_negates_guarded():
    W1, W2 = mat(5, 4), mat(4, 4)

    def G(z):
        h = torch.tanh(z @ W1)
        if h.requires_grad:
            h.register_hook(lambda g: -g)
        return torch.tanh(h @ W2) + h

    return problem(G, rand(4, 5))


@case("grad mode", expect="exact|refused", match=r"hook")
def grad_tensor_hook_clips():
    W1, W2 = mat(5, 4), mat(4, 4)

    def G(z):
        h = torch.tanh(z @ W1)
        h.register_hook(lambda g: g.clamp(-0.05, 0.05))
        return torch.tanh(h @ W2) + h

    return problem(G, rand(4, 5))


class HookedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 4, dtype=DT)
        self.b = nn.Linear(4, 4, dtype=DT)

    def forward(self, z):
        h = torch.tanh(self.a(z))
        return torch.tanh(self.b(h)) + h


@case("grad mode")
def grad_module_full_backward_hook_scales():
    net = HookedNet().eval()
    net.b.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
    return problem(net, rand(4, 5))


@case("grad mode", expect="exact|refused", match=r"hook")
def grad_module_full_backward_hook_clips():
    net = HookedNet().eval()
    net.b.register_full_backward_hook(lambda m, gi, go: (gi[0].clamp(-0.05, 0.05),))
    return problem(net, rand(4, 5))


@case("grad mode", expect="refused", match=r"hook")
def grad_module_full_backward_hook_clips_strategy_forward():
    p = grad_module_full_backward_hook_clips()
    p.run = lambda: mixedad.mixed_grad(p.f, p.G, p.z, p.y, p.v, strategy="forward")
    return p


def energy(x, W):
    return (torch.tanh(x @ W) ** 2).sum() + (x ** 4).sum() / 4


@case("grad mode")
def grad_energy_autograd_grad_of_z():
    W = mat(5, 5)

    def G(z):  # assumes z requires grad, as it does under double backward
        with torch.enable_grad():
            (g,) = torch.autograd.grad(energy(z, W), z, create_graph=True)
        return -g

    return problem(G, rand(4, 5))


@case("grad mode")
def grad_energy_detach_if_needed():
    W = mat(5, 5)

    def G(z):
        with torch.enable_grad():
            x = z if z.requires_grad else z.detach().requires_grad_()
            (g,) = torch.autograd.grad(energy(x, W), x, create_graph=True)
        return -g

    return problem(G, rand(4, 5))


@case("grad mode")
def grad_energy_torch_func_grad():
    W = mat(5, 5)
    return problem(lambda z: -torch.func.grad(lambda x: energy(x, W))(z), rand(4, 5))


def threaded(fn):
    def G(z):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(fn, z).result()

    return G


@case("grad mode")
def thread_plain_ops():
    W1, W2 = mat(5, 4), mat(4, 4)
    return problem(threaded(lambda z: torch.tanh(torch.tanh(z @ W1) @ W2)), rand(4, 5))


@case("grad mode")
def thread_no_grad_region():
    W1, W2 = mat(5, 4), mat(4, 4)

    def body(z):
        h = torch.tanh(z @ W1)
        with torch.no_grad():
            c = (h @ W2).sin()
        return h * c + h ** 2

    return problem(threaded(body), rand(4, 5))


@case("grad mode")
def thread_custom_function_without_jvp():
    W1, W2 = mat(5, 4), mat(4, 4)
    return problem(threaded(lambda z: OldStyleExp.apply(torch.tanh(z @ W1)) @ W2), rand(4, 5))


@case("grad mode")
def grad_inplace_clamp_under_no_grad():
    W1, W2 = mat(5, 4), mat(4, 4)

    def G(z):
        h = z @ W1
        with torch.no_grad():
            h.clamp_(-0.3, 0.3)  # value clamped, gradient passes as identity (straight through)
        return torch.tanh(h @ W2) + h

    return problem(G, rand(4, 5))


@case("grad mode")
def grad_straight_through_detach():
    W1 = mat(5, 4)

    def G(z):
        h = torch.tanh(z @ W1) * 3
        return h + (h.round() - h).detach()

    return problem(G, rand(4, 5))


@case("grad mode")
def grad_branch_on_is_grad_enabled():
    W1 = mat(5, 4)

    def G(z):
        h = z @ W1
        return torch.tanh(h) if torch.is_grad_enabled() else h.clamp(-1, 1)

    return problem(G, rand(4, 5))


def _checkpointed(use_reentrant):
    W1, W2 = mat(5, 4), mat(4, 4)

    def block(h):
        with torch.no_grad():
            c = (h @ W2).sin()
        return torch.tanh(h @ W2) * c + h

    def G(z):
        h = torch.tanh(z @ W1)
        return torch.utils.checkpoint.checkpoint(block, h, use_reentrant=use_reentrant)

    return problem(G, rand(4, 5))


@case("grad mode")
def grad_checkpoint_non_reentrant_with_no_grad_inside():
    return _checkpointed(False)


@case("grad mode")
def grad_checkpoint_reentrant_with_no_grad_inside():
    p = _checkpointed(True)
    torch.manual_seed(0)
    p.truth_G = _checkpointed(False).G  # the same weights: .grad() refuses reentrant checkpoints
    return p


@case("grad mode")
def grad_inference_mode_false_inside_inference_mode():
    def region(h, W2, W3):
        with torch.inference_mode():
            c = (h @ W2).sin()
            with torch.inference_mode(False):
                d = (h @ W3).cos()  # grad mode is back on here
        return c.clone(), d

    return region_problem(region)


@case("grad mode")
def grad_G_uses_forward_ad_inside():
    W1, W2 = mat(5, 4), mat(4, 4)
    u_row = rand(4)

    def G(z):
        h = torch.tanh(z @ W1)
        u = u_row * torch.ones(h.shape, dtype=h.dtype)  # per code, so that chunks work
        with forward_ad.dual_level():
            o = forward_ad.unpack_dual(torch.tanh(forward_ad.make_dual(h, u) @ W2)).tangent
        return h + o

    return problem(G, rand(4, 5))


@case("grad mode")
def grad_G_uses_torch_func_jvp_inside():
    W1, W2 = mat(5, 4), mat(4, 4)
    u_row = rand(4)

    def G(z):
        h = torch.tanh(z @ W1)
        u = u_row * torch.ones(h.shape, dtype=h.dtype)
        return h + torch.func.jvp(lambda a: torch.tanh(a @ W2), (h,), (u,))[1]

    return problem(G, rand(4, 5))


@case("grad mode")
def grad_G_uses_vmap_inside():
    W1, W2 = mat(5, 4), mat(4, 4)

    def G(z):
        h = torch.tanh(z @ W1)
        return torch.func.vmap(lambda row: torch.tanh(row @ W2) * row.sum())(h)

    return problem(G, rand(4, 5))


class EmaNet(nn.Module):
    """Uses an EMA buffer, then updates it under no_grad."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 4, dtype=DT)
        self.register_buffer("ema", torch.zeros(4, dtype=DT))

    def forward(self, z):
        h = torch.tanh(self.a(z))
        out = (h - self.ema) * h
        with torch.no_grad():
            self.ema.mul_(0.5).add_(0.5 * h.mean(0))
        return out


@case("grad mode", stateful=True)
def grad_ema_buffer_updated_under_no_grad():
    return problem(EmaNet().train(), rand(4, 5))


@case("grad mode", random=True)
def grad_noise_in_no_grad_region():
    W1 = mat(5, 4)

    def G(z):
        h = torch.tanh(z @ W1)
        with torch.no_grad():
            noise = torch.randn_like(h) * 0.3
        return h * (1 + noise) + noise

    return problem(G, rand(4, 5))


@case("grad mode")
def thread_custom_function_bad_jvp():
    W1, W2 = mat(5, 4), mat(4, 4)
    return problem(threaded(lambda z: BadJvpSin.apply(torch.tanh(z @ W1)) @ W2), rand(4, 5))


@case("grad mode")
def thread_plain_set_grad_enabled_in_worker():
    W1, W2 = mat(5, 4), mat(4, 4)

    def body(z):
        h = torch.tanh(z @ W1)
        torch.set_grad_enabled(False)
        c = (h @ W2).sin()
        torch.set_grad_enabled(True)
        return h * c

    return problem(threaded(body), rand(4, 5))


# ----------------------------------------------------------------------------------------------
# Area 4: generators, iterators, output structures
# ----------------------------------------------------------------------------------------------

def constant_stage(h, W):
    with torch.no_grad():
        received = yield (h @ W).sin()
        yield received.cos()


@case("generators")
def gen_suspended_inside_no_grad_closed():
    W1, W2 = mat(5, 4), mat(4, 4)

    def G(z):
        h = torch.tanh(z @ W1)
        base = h.pow(2) + h
        it = constant_stage(h, W2)
        c = next(it)            # the generator is suspended inside no_grad: grad is off here
        u = h * 3               # a constant under double backward
        t = it.send(u)
        it.close()              # the region ends: grad back on
        return base + h * (c + t)

    return problem(G, rand(4, 5))


@case("generators")
def gen_suspended_closed_by_gc_at_return():
    W1, W2 = mat(5, 4), mat(4, 4)

    def G(z):
        h = torch.tanh(z @ W1)
        base = h.pow(2) + h     # differentiable
        it = constant_stage(h, W2)
        c = next(it)            # grad off from here until `it` is collected at return
        extra = h * c           # a constant under double backward
        return base, extra

    return problem(G, rand(4, 5))


@case("generators")
def gen_exhausted_by_next():
    W1, W2 = mat(5, 4), mat(4, 4)

    def values(h):
        with torch.no_grad():
            yield (h @ W2).sin()
        yield h.cos()          # after the region: differentiable

    def G(z):
        h = torch.tanh(z @ W1)
        c, d = list(values(h))
        return h * c + d

    return problem(G, rand(4, 5))


@case("generators")
def gen_G_is_a_generator_closure():
    W1, W2 = mat(5, 4), mat(4, 4)

    def body():
        out = None
        while True:
            z = yield out
            h = torch.tanh(z @ W1)
            with torch.no_grad():
                c = (h @ W2).sin()
            out = h * c + h ** 2

    gen = body()
    next(gen)
    return problem(gen.send, rand(4, 5))


@case("generators", expect="refused", match=r"tensor")  # double backward: z "not used in the graph"
def out_empty_tuple():
    return problem(lambda z: (), rand(4, 5))


@case("generators")
def out_dict():
    W1, W2 = mat(5, 4), mat(5, 3)
    return problem(lambda z: {"img": torch.tanh(z @ W1), "aux": (z @ W2).sin()}, rand(4, 5))


@case("generators")
def out_nested_tuples():
    W1, W2 = mat(5, 4), mat(5, 3)
    return problem(lambda z: ((torch.tanh(z @ W1), (z @ W2).sin()), ((z @ W1).pow(2),)), rand(4, 5))


@case("generators")
def out_non_tensor_leaf():
    W1 = mat(5, 4)
    return problem(lambda z: (torch.tanh(z @ W1), 3, "steps"), rand(4, 5))


@case("generators")
def out_integer_tensor_leaf():
    W1 = mat(5, 4)

    def G(z):
        h = torch.tanh(z @ W1)
        return h, h.argmax(-1)  # (image, codebook indices) as a VQ decoder returns

    return problem(G, rand(4, 5))


@case("generators")
def out_none_leaf():
    W1 = mat(5, 4)
    return problem(lambda z: {"img": torch.tanh(z @ W1), "mask": None}, rand(4, 5))


@case("generators")
def gen_enable_grad_generator_inside_no_grad():
    W1 = mat(5, 4)

    def differentiable(h):
        with torch.enable_grad():
            yield h.cos()

    def G(z):
        h = torch.tanh(z @ W1)
        with torch.no_grad():
            it = differentiable(h)
            c = next(it)       # suspended inside enable_grad: grad is ON here, inside G's no_grad block
            d = h.sin() * c    # differentiable under double backward
            it.close()         # back to the no_grad block
            e = h.exp()        # a constant
        return h + c + d + e

    return problem(G, rand(4, 5))


@case("generators")
def out_list():
    W1, W2 = mat(5, 4), mat(5, 3)
    return problem(lambda z: [torch.tanh(z @ W1), (z @ W2).sin()], rand(4, 5))


Pair = __import__("collections").namedtuple("Pair", ["img", "aux"])


@case("generators")
def out_namedtuple():
    W1, W2 = mat(5, 4), mat(5, 3)
    return problem(lambda z: Pair(torch.tanh(z @ W1), (z @ W2).sin()), rand(4, 5))


@case("generators")
def out_ordered_dict():
    W1, W2 = mat(5, 4), mat(5, 3)
    OD = __import__("collections").OrderedDict
    return problem(lambda z: OD(b=(z @ W2).sin(), a=torch.tanh(z @ W1)), rand(4, 5))


@case("generators")
def out_identity_G():
    return problem(lambda z: z, rand(4, 5))


@case("generators")
def out_view_of_z():
    return problem(lambda z: z[:, 1:].t(), rand(4, 5))


@case("generators")
def out_same_tensor_twice():
    W1 = mat(5, 4)

    def G(z):
        h = torch.tanh(z @ W1)
        return h, h

    return problem(G, rand(4, 5))


@case("generators")
def out_one_leaf_constant():
    W1 = mat(5, 4)
    const = rand(3, 4)
    return problem(lambda z: (torch.tanh(z @ W1), const), rand(4, 5))


@case("generators")
def out_zero_dim():
    W1 = mat(5, 4)
    return problem(lambda z: torch.tanh(z @ W1).sum(), rand(4, 5))


# ----------------------------------------------------------------------------------------------
# Area 5: nested calls
# ----------------------------------------------------------------------------------------------

def inner_problem():
    Wi = mat(5, 5)
    G_in = lambda c: torch.tanh(c @ Wi)  # noqa: E731
    f_in = lambda y, g: (torch.sin(y * g) * g).sum()  # noqa: E731
    return G_in, f_in, rand(4, 5)


@case("nested", expect="refused", match=r"called inside G while mixed_grad.*cannot nest")
def nested_mixed_grad_inside_G():
    G_in, f_in, c = inner_problem()
    W = mat(5, 5)

    def G(z):
        h = torch.tanh(z @ W)
        return h + mixedad.mixed_grad(f_in, G_in, c, h, create_graph=True)

    return problem(G, rand(4, 5))


@case("nested", expect="refused", match=r"input_grad")
def nested_input_grad_inside_G():
    G_in, f_in, c = inner_problem()
    W = mat(5, 5)

    def G(z):
        h = torch.tanh(z @ W)
        return h + mixedad.input_grad(f_in, G_in, c, h)

    return problem(G, rand(4, 5))


@case("nested")
def nested_mixed_grad_inside_f():
    G_in, f_in, c = inner_problem()
    W = mat(5, 4)

    def f(y, g):
        m = mixedad.mixed_grad(f_in, G_in, c, y, create_graph=True)   # (4, 5), differentiable in y
        return (m[:, :4] * g).sum() + (torch.sin(g) * m[:, 1:]).sum()

    return problem(lambda z: torch.tanh(z @ W), rand(4, 5), y=rand(4, 5), f=f)


@case("nested")
def nested_inside_user_dual_level():
    W1, W2 = mat(5, 4), mat(4, 4)
    p = problem(lambda z: torch.tanh(torch.tanh(z @ W1) @ W2), rand(4, 5))

    def run():
        with forward_ad.dual_level():
            return mixedad.mixed_grad(p.f, p.G, p.z, p.y, p.v)

    p.run = run
    return p


@case("nested", expect="refused", match=r"dual")
def nested_dual_y_inside_user_dual_level():
    W1 = mat(5, 4)
    p = problem(lambda z: torch.tanh(z @ W1), rand(4, 5))

    def run():
        with forward_ad.dual_level():
            y = forward_ad.make_dual(p.y, torch.ones_like(p.y))
            return forward_ad.unpack_dual(mixedad.mixed_grad(p.f, p.G, p.z, y, p.v)).primal

    p.run = run
    return p


def third_order_truth(p, w):
    """d/dy <w, d/dy <v, df/dz>> by hand."""
    def truth():
        with math_attention():
            zr = p.z.detach().clone().requires_grad_()
            yr = p.y.detach().clone().requires_grad_()
            (gz,) = torch.autograd.grad(p.f(yr, p.G(zr)), zr, create_graph=True)
            (gy,) = torch.autograd.grad(gz, yr, p.v, create_graph=True)
            (gyy,) = torch.autograd.grad(gy, yr, w)
        return gyy

    return truth


@case("nested")
def nested_torch_func_grad_over_mixed_grad():
    W1, W2 = mat(5, 4), mat(4, 4)
    p = problem(lambda z: torch.tanh(torch.tanh(z @ W1) @ W2), rand(4, 5))
    w = rand(8)
    p.run = lambda: torch.func.grad(lambda y: (mixedad.mixed_grad(p.f, p.G, p.z, y, p.v) * w).sum())(p.y)
    p.truth = third_order_truth(p, w)
    return p


@case("nested")
def nested_torch_func_jvp_over_mixed_grad():
    W1, W2 = mat(5, 4), mat(4, 4)
    p = problem(lambda z: torch.tanh(torch.tanh(z @ W1) @ W2), rand(4, 5))
    w = rand(8)

    def run():
        return torch.func.jvp(lambda y: mixedad.mixed_grad(p.f, p.G, p.z, y, p.v), (p.y,), (w,))[1]

    def truth():  # the Hessian of <v, df/dz> in y is symmetric: its jvp equals the vjp
        return third_order_truth(p, w)()

    p.run, p.truth = run, truth
    return p


@case("nested")
def nested_vmap_over_v_with_no_grad_region():
    p = grad_with_no_grad()
    V = rand(3, *p.z.shape)
    p.run = lambda: torch.func.vmap(lambda v: mixedad.mixed_grad(p.f, p.G, p.z, p.y, v))(V)
    p.truth = lambda: torch.stack([truth_mixed_grad(p.f, p.G, p.z, p.y, v) for v in V])
    return p


@case("nested", expect="refused", match=r"torch.func can only push tangents through a Function that defines")
def nested_vmap_over_y_with_custom_function():
    p = fn_gradient_reversal()
    Y = rand(3, 8)
    p.run = lambda: torch.func.vmap(lambda y: mixedad.mixed_grad(p.f, p.G, p.z, y, p.v))(Y)
    p.truth = lambda: torch.stack([truth_mixed_grad(p.f, p.G, p.z, y, p.v) for y in Y])
    return p


@case("nested", expect="exact|refused", match=r"compile")
def nested_inside_torch_compile():
    W1, W2 = mat(5, 4), mat(4, 4)
    p = problem(lambda z: torch.tanh(torch.tanh(z @ W1) @ W2), rand(4, 5))

    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(1))  # dynamo patches nn.Module on first use

    def run():
        torch._dynamo.reset()
        compiled = torch.compile(lambda y: mixedad.mixed_grad(p.f, p.G, p.z, y, p.v), backend="eager")
        try:
            return compiled(p.y)
        finally:
            torch._dynamo.reset()

    p.run = run
    return p


@case("nested")
def nested_compiled_G_with_no_grad_region():
    p = grad_with_no_grad()
    G = p.G
    p.G = torch.compile(G, backend="eager")
    p.truth = lambda: truth_mixed_grad(p.f, G, p.z, p.y, p.v)
    return p


@case("nested")
def nested_outer_no_grad_with_region_inside_G():
    p = grad_enable_grad_inside_no_grad()

    def run():
        with torch.no_grad():
            return mixedad.mixed_grad(p.f, p.G, p.z, p.y, p.v)

    p.run = run
    return p


@case("nested")
def nested_outer_inference_mode_with_region_inside_G():
    p = grad_enable_grad_inside_no_grad()

    def run():
        with torch.inference_mode():
            return mixedad.mixed_grad(p.f, p.G, p.z, p.y, p.v).clone()

    p.run = run
    return p


@case("nested")
def nested_func_grad_over_input_grad():
    p = grad_with_no_grad()
    W = rand(*p.z.shape)
    p.run = lambda: torch.func.grad(lambda y: outer_loss(mixedad.input_grad(p.f, p.G, p.z, y), W))(p.y)
    p.truth = lambda: truth_input_grad(p.f, p.G, p.z, p.y, W, p.z.shape[0])[1]
    return p


@case("nested")
def nested_vmap_over_z_and_v():
    p = grad_enable_grad_inside_no_grad()
    Z, V = rand(3, *p.z.shape), rand(3, *p.z.shape)
    p.run = lambda: torch.func.vmap(lambda z, v: mixedad.mixed_grad(p.f, p.G, z, p.y, v))(Z, V)
    p.truth = lambda: torch.stack([truth_mixed_grad(p.f, p.G, z, p.y, v) for z, v in zip(Z, V)])
    return p


@case("nested")
def nested_jacrev_over_mixed_grad():
    p = grad_with_no_grad()
    p.run = lambda: torch.func.jacrev(lambda y: mixedad.mixed_grad(p.f, p.G, p.z, y, p.v))(p.y)
    p.truth = lambda: torch.stack([third_order_truth(p, e)() for e in torch.eye(8, dtype=DT)])  # symmetric
    return p


class PassThroughMode(torch.overrides.TorchFunctionMode):
    calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        PassThroughMode.calls += 1
        return func(*args, **(kwargs or {}))


@case("nested")
def nested_inside_user_torch_function_mode():
    p = grad_with_no_grad()

    def run():
        with PassThroughMode():
            return mixedad.mixed_grad(p.f, p.G, p.z, p.y, p.v)

    p.run = run
    return p


@case("nested")
def nested_inside_flop_counter_dispatch_mode():
    from torch.utils.flop_counter import FlopCounterMode

    p = fn_jvp_disagrees_with_backward()

    def run():
        with FlopCounterMode(display=False):
            return mixedad.mixed_grad(p.f, p.G, p.z, p.y, p.v)

    p.run = run
    return p


@case("nested")
def nested_inside_detect_anomaly():
    p = grad_plain_set_grad_enabled_calls()

    def run():
        with torch.autograd.detect_anomaly():
            return mixedad.mixed_grad(p.f, p.G, p.z, p.y, p.v)

    p.run = run
    return p


@case("nested")
def nested_inside_saved_tensors_hooks():
    p = fn_old_style_no_setup_context()

    def run():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            return mixedad.mixed_grad(p.f, p.G, p.z, p.y, p.v)

    p.run = run
    return p


@case("nested")
def nested_y_dict_with_aliased_leaves():
    W1 = mat(5, 4)
    t = rand(4)

    def f(y, g):
        return (torch.sin(g * y["a"]) + g ** 2 * y["b"].cos()).sum() + (g.sum(0) * y["a"] * y["b"]).sum()

    return problem(lambda z: torch.tanh(z @ W1), rand(4, 5), y={"a": t, "b": t}, f=f)


# ----------------------------------------------------------------------------------------------
# Area 6: mixed_jacobian and input_grad (chunk_size=2) over a handful of the above
# ----------------------------------------------------------------------------------------------

def _register_reuse(call, names, expect_for=None):
    expect_for = expect_for or {}
    for name in names:
        builder = globals()[name]
        source = next(c for c in CASES if c.name == name)
        expect, match = expect_for.get(name, (source.expect, source.match))
        if match is not None:
            match = match.replace("mixed_grad", call)
        wrapped = (lambda b: lambda: b())(builder)
        wrapped.__name__ = f"{call}__{name}"
        case(f"{call}", expect=expect, match=match, call=call, random=source.random,
             stateful=source.stateful)(wrapped)


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 6, dtype=DT), nn.Tanh(), nn.Dropout(0.4), nn.Linear(6, 4, dtype=DT))

    def forward(self, z):
        h = self.net(z)
        with torch.no_grad():
            c = F.dropout(h, 0.3, training=self.training)
        return h * c + h


@case("grad mode", random=True)
def train_mode_dropout_with_no_grad_region():
    return problem(DropoutNet().train(), rand(4, 5))


# mixed_jacobian over a handful of the above (z of 4 x 5 = 20 rows at most)
_register_reuse("mixed_jacobian", [
    "grad_with_no_grad",
    "grad_plain_set_grad_enabled_calls",
    "grad_enable_grad_inside_no_grad",
    "fn_jvp_disagrees_with_backward",
    "fn_gradient_reversal",
    "fn_old_style_no_setup_context",
    "fn_clip_gradient",
    "out_dict",
    "gen_suspended_inside_no_grad_closed",
    "train_mode_dropout_with_no_grad_region",
    "thread_no_grad_region",
    "grad_inference_mode_inside_G",
    "grad_tensor_hook_negates",
    "grad_energy_torch_func_grad",
    "grad_G_leaves_grad_mode_off",
    "grad_branch_on_is_grad_enabled",
    "grad_checkpoint_non_reentrant_with_no_grad_inside",
    "gen_enable_grad_generator_inside_no_grad",
    "fn_dropout_inside_function_forward",
    "grad_C_set_grad_enabled",
    "grad_with_set_grad_enabled_false",
    "gen_G_is_a_generator_closure",
    "grad_inplace_clamp_under_no_grad",
    "fn_grad_mode_toggled_in_forward",
    "grad_energy_autograd_grad_of_z",
    "grad_module_full_backward_hook_scales",
    "grad_G_uses_vmap_inside",
    "fn_inplace_mark_dirty_no_jvp",
    "fn_non_differentiable_second_output",
])


@case("mixed_jacobian", call="mixed_jacobian")
def mixed_jacobian__sdpa_bool_all_false_row():
    mask = torch.tensor([[1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    return sdpa_problem(mask, N=1, H=1, L=3, S=3, E=3)


@case("mixed_jacobian", call="mixed_jacobian")
def mixed_jacobian__mha_key_padding_whole_sequence():
    m = mha()
    kpm = torch.tensor([[False, True], [True, True]])
    return problem(lambda z: m(z, z, z, key_padding_mask=kpm, need_weights=False)[0], rand(2, 2, 4), modules=[m])


# input_grad(chunk_size=2): G must be per code along z's dim 0 (masks of shape (L, S) only)
_register_reuse("input_grad", [
    "grad_with_no_grad",
    "grad_plain_set_grad_enabled_calls",
    "grad_C_set_grad_enabled",
    "grad_enable_grad_inside_no_grad",
    "grad_tensor_hook_negates",
    "fn_jvp_disagrees_with_backward",
    "fn_clip_gradient",
    "fn_old_style_no_setup_context",
    "gen_suspended_inside_no_grad_closed",
    "train_mode_dropout_with_no_grad_region",
    "thread_no_grad_region",
    "grad_inference_mode_inside_G",
    "grad_energy_autograd_grad_of_z",
    "grad_module_full_backward_hook_scales",
    "gen_G_is_a_generator_closure",
    "fn_once_differentiable_no_jvp",
    "grad_branch_on_is_grad_enabled",
    "grad_ema_buffer_updated_under_no_grad",
    "fn_dropout_inside_function_forward",
    "grad_G_leaves_grad_mode_off",
    "grad_energy_torch_func_grad",
    "grad_G_uses_forward_ad_inside",
    "grad_G_uses_torch_func_jvp_inside",
    "fn_backward_affine_in_gradient",
    "grad_inplace_clamp_under_no_grad",
    "out_dict",
    "grad_noise_in_no_grad_region",
])


@case("input_grad", call="input_grad")
def input_grad__sdpa_additive_neg_inf_row():
    mask = rand(4, 4)
    mask[2] = float("-inf")
    return sdpa_problem(mask, N=4, H=2)


@case("input_grad", call="input_grad")
def input_grad__encoder_layer_src_mask():
    layer = encoder_layer()
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[1] = True  # row 1 sees no key
    return problem(lambda z: layer(z, src_mask=mask), rand(4, 4, 4), modules=[layer])


# ----------------------------------------------------------------------------------------------
# Area 7: the checking tools themselves
# ----------------------------------------------------------------------------------------------

def spot_checked(builder):
    def build():
        p = builder()
        p.run = lambda: (mixedad.testing.spot_check(p.f, p.G, p.z, p.y, p.v, stream=io.StringIO()),
                         mixedad.mixed_grad(p.f, p.G, p.z, p.y, p.v))[1]
        return p

    return build


for _name in ["grad_plain_set_grad_enabled_calls", "fn_jvp_disagrees_with_backward", "grad_tensor_hook_negates",
              "thread_no_grad_region", "thread_custom_function_bad_jvp", "grad_tensor_hook_negates_guarded",
              "sdpa_bool_LS_all_false_row"]:
    _b = spot_checked(globals()[_name])
    _b.__name__ = f"spot_check__{_name}"
    case("spot_check / tangent_report")(_b)


@case("spot_check / tangent_report")
def tangent_report_then_mixed_grad_no_grad_region():
    p = grad_enable_grad_inside_no_grad()
    p.run = lambda: (str(mixedad.tangent_report(p.G, p.z, p.v)), mixedad.mixed_grad(p.f, p.G, p.z, p.y, p.v))[1]
    return p


# ----------------------------------------------------------------------------------------------
# Ground truth: double backward by hand
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# The harness: run, compare, look for leaks
# ----------------------------------------------------------------------------------------------


def _modules(p):
    mods = list(p.modules) if hasattr(p, "modules") else []
    if isinstance(p.G, nn.Module):
        mods.append(p.G)
    if isinstance(getattr(p.G, "_orig_mod", None), nn.Module):
        mods.append(p.G._orig_mod)
    out = []
    for m in mods:
        out.extend(m.modules())
    return out


def _tensors(p):
    ts = [t for t in tree_leaves((p.z, p.y, p.v)) if isinstance(t, torch.Tensor)]
    for m in _modules(p):
        ts.extend(m.parameters(recurse=False))
    return ts


def _state(p):
    mods = _modules(p)
    tensors = _tensors(p)
    return {
        "TorchFunctionMode stack": torch._C._len_torch_function_stack(),
        "TorchDispatchMode stack": torch._C._len_torch_dispatch_stack(),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "anomaly mode": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "forward-AD level": forward_ad._current_level,
        "forward grad mode": torch._C._is_fwd_grad_enabled(),
        "functorch level": torch._C._functorch.maybe_current_level(),
        "MHA fast path": torch.backends.mha.get_fastpath_enabled(),
        "SDPA flags": (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                       torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()),
        "requires_grad flags": [t.requires_grad for t in tensors],
        ".grad fields": [None if t.grad is None else id(t.grad) for t in tensors],
        "module training flags": [m.training for m in mods],
        "module attributes": [sorted(vars(m)) for m in mods],
        "module hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                          len(m._backward_pre_hooks)) for m in mods],
        "global module hooks": tuple(len(getattr(nn.modules.module, name)) for name in (
            "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
            "_global_backward_pre_hooks")),
        "buffers": [b.detach().clone() for m in mods for b in m.buffers(recurse=False)],
    }


def _leaks(before, after, attrs_before, rng_expected):
    leaks = []
    for key, value in before.items():
        other = after[key]
        if key == "buffers":
            same = len(value) == len(other) and all(torch.equal(a, b) for a, b in zip(value, other))
        else:
            same = value == other
        if not same:
            leaks.append(f"{key} {value} -> {other}" if key != "buffers" else
                         "buffers differ from one plain forward of G")
    if forward_ad._current_level != -1:
        leaks.append(f"forward_ad._current_level == {forward_ad._current_level}")
    attrs_after = _attributes()
    changed = sorted(k for k in attrs_before if k in attrs_after and attrs_before[k] != attrs_after[k])
    gone = sorted(k for k in attrs_before if k not in attrs_after)
    if changed or gone:
        leaks.append(f"torch attributes patched: {', '.join(changed + gone)}")
    if not torch.equal(torch.get_rng_state(), rng_expected):
        leaks.append("CPU RNG state differs from one plain forward of G")
    return leaks


def _buffers(p):
    return [b for m in _modules(p) for b in m.buffers(recurse=False)]


def _restore_buffers(p, saved):
    with torch.no_grad():
        for b, s in zip(_buffers(p), saved):
            b.copy_(s)


def _plain_forward_effects(c, p, rng0):
    """The CPU RNG state and buffers one plain forward of G leaves (per chunk for input_grad)."""
    buffers0 = [b.detach().clone() for b in _buffers(p)]
    if not (c.random or c.stateful):
        return rng0.clone(), buffers0
    torch.set_rng_state(rng0)
    with torch.no_grad(), math_attention():
        if c.call == "input_grad":
            for i in range(0, p.z.shape[0], c.chunk):
                p.G(p.z[i:i + c.chunk])
        else:
            p.G(p.z)
    after = torch.get_rng_state(), [b.detach().clone() for b in _buffers(p)]
    torch.set_rng_state(rng0)
    _restore_buffers(p, buffers0)
    return after


def evaluate(c):
    """Run one case. Returns (verdict, detail, leaks, warnings, error message or None)."""
    torch.manual_seed(0)
    p = c.build()
    assert c.call != "mixed_jacobian" or p.z.numel() <= 24, "keep mixed_jacobian cases small"
    if c.call == "input_grad":
        p.y_user = tree_map(lambda t: t.detach().clone().requires_grad_(), p.y)
        p.W = rand(*p.z.shape)
    torch.manual_seed(1)
    rng0 = torch.get_rng_state()
    rng_expected, buffers_expected = _plain_forward_effects(c, p, rng0)
    buffers0 = [b.detach().clone() for b in _buffers(p)]

    torch.set_rng_state(rng0)
    truth, truth_error = truth_or_error(c, p)
    torch.set_rng_state(rng0)
    _restore_buffers(p, buffers0)

    attrs_before = _attributes()
    before = _state(p)
    before["buffers"] = buffers_expected
    result, error, caught = run_recording(c, p)
    leaks = _leaks(before, _state(p), attrs_before, rng_expected)
    return verdict(result, error, truth, truth_error, leaks, caught, own_error=_own_error, rtol=RTOL)


def _own_error(error, text):
    return bool(OWN_ERROR.match(text)) or isinstance(error, AssertionError) and text.startswith("spot_check(")


def check(c):
    _check(c, evaluate)


#: Cases still open, each with its reason: strict, so a fix shows up as an unexpected pass.
OPEN = {
}


@pytest.mark.parametrize("c", cases_with_open_marked(CASES, OPEN), ids=[c.name for c in CASES])
def test_seam(c):
    check(c)


def test_there_are_enough_cases():
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES)


if __name__ == "__main__":
    print_table(CASES, evaluate)
