"""Pins for mixedad._hooks.attention_backends: the math backend, the fast-path flag, and no fast path under a mode."""
import pytest
import torch
from torch import nn

from mixedad._hooks import attention_backends as hook

from tests._hooks.recording import Seen



def test_the_fast_path_flag_is_switched_off_and_restored():
    before = torch.backends.mha.get_fastpath_enabled()
    with hook.differentiable_attention():
        assert not torch.backends.mha.get_fastpath_enabled()
    assert torch.backends.mha.get_fastpath_enabled() == before


def test_multihead_attention_takes_no_fast_path_while_a_torch_function_mode_is_active():
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    mode = Seen()
    with torch.no_grad(), mode:  # eval and no_grad: the conditions where torch would take the fast path
        mha(x, x, x)
    assert torch._native_multi_head_attention not in mode.funcs
    assert torch.nn.functional.multi_head_attention_forward in mode.funcs


def test_math_backend_gives_the_reference_numbers():
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    with hook.math_backend():
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    expected = torch.softmax(q @ q.mT / 8 ** 0.5, -1) @ q
    assert torch.allclose(out, expected)


def test_the_fused_flags_read_false_inside_the_math_backend():
    assert hook.fused_attention_enabled()
    with hook.math_backend():
        assert not hook.fused_attention_enabled()
    assert hook.fused_attention_enabled()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["causal", "additive mask", "scale", "cross lengths"])
def test_the_cpu_flash_kernel_is_sdpa_bit_for_bit_and_hands_out_the_row_log_sum_exp(case, dtype):
    import math

    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    lk = 9 if case == "cross lengths" else 6
    q = torch.randn(2, 3, 6, 4, generator=gen, dtype=dtype)
    k, v = (torch.randn(2, 3, lk, 4, generator=gen, dtype=dtype) for _ in range(2))
    mask = torch.randn(6, lk, generator=gen, dtype=dtype) if case == "additive mask" else None
    is_causal, scale = case == "causal", 0.3 if case == "scale" else None
    result = hook.fused_attention_with_lse(q, k, v, mask, is_causal, scale)
    assert result is not None, "SDPA no longer takes the CPU flash kernel here"
    out, lse = result
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale))
    scores = q @ k.mT * (1 / math.sqrt(4) if scale is None else scale)
    if mask is not None:
        scores = scores + mask
    if is_causal:
        scores = scores.masked_fill(torch.ones(6, lk, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


def test_where_sdpa_may_take_another_path_no_log_sum_exp_is_offered():
    q = torch.randn(2, 3, 6, 4)
    assert hook.fused_attention_with_lse(q, q, q, torch.ones(6, 6, dtype=torch.bool), False, None) is None  # bool mask
    assert hook.fused_attention_with_lse(q[0], q[0], q[0], None, False, None) is None  # 3-d
    assert hook.fused_attention_with_lse(q.half(), q.half(), q.half(), None, False, None) is None
    assert hook.fused_attention_with_lse(q, q[:, :1], q[:, :1], None, False, None) is None  # heads differ
    assert hook.fused_attention_with_lse(q.to("meta"), q.to("meta"), q.to("meta"), None, False, None) is None
