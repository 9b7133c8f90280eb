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


def test_where_the_rule_computes_the_primal_in_its_own_blocks():
    """Plain CPU tensors SDPA accepts, outside autocast and with no graph to build; meta ones only in a CPU plan."""
    q = torch.randn(2, 3, 6, 4)
    here = hook.blockwise_primal_here
    assert here(q, q, q, None) and here(q[0, 0], q[0, 0], q[0, 0], None)  # any number of batch dims
    assert here(q, q, q, torch.ones(6, 6, dtype=torch.bool)) and here(q, q, q, torch.zeros(6, 6))
    assert here(q.half(), q.half(), q.half(), None) and here(q, q[:, :1], q[:, :1], None)
    assert here(q, torch.nn.Parameter(q, requires_grad=False), q, None)
    assert not here(q, q.double(), q, None)  # SDPA refuses: the user's call raises its error
    assert not here(q, q, q, torch.zeros(6, 6, dtype=torch.float64))
    assert not here(q, q[..., :3], q, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not here(q, q, q, None)  # SDPA picks the dtype
    grad = q.clone().requires_grad_()
    assert not here(grad, q, q, None)
    with torch.no_grad():
        assert here(grad, q, q, None)
    meta = q.to("meta")
    assert not here(meta, meta, meta, None)
    with hook.planning_for("cpu"):
        assert here(meta, meta, meta, None)
    with hook.planning_for("cuda"):
        assert not here(meta, meta, meta, None)
