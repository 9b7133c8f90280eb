"""Pins for mixedad._hooks.attention_backends: the math backend, the fast-path flag, and no fast path under a mode."""
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
