"""The target device's fused attention, emulated on meta: the allocations of the fused kernel."""
import torch
import torch.nn.functional as F

from mixedad._hooks.attention_backends import math_backend
from mixedad._planner.target import TargetDevice
from mixedad.profiling import StorageCounter, cpu_peak_memory


def _qkv(device):
    return [torch.empty(2, 4, 512, 16, device=device) if device == "meta" else torch.randn(2, 4, 512, 16)
            for _ in range(3)]


def test_fused_attention_on_meta_holds_what_the_cpu_kernel_holds():
    inputs = _qkv("cpu")
    _, cpu = cpu_peak_memory(lambda: F.scaled_dot_product_attention(*inputs, is_causal=True))
    q, k, v = _qkv("meta")
    with TargetDevice("cpu"), StorageCounter(meta=True) as counter:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.is_meta and out.shape == (2, 4, 512, 16)
    assert counter.peak == cpu  # output plus a float32 log-sum-exp per query
    with StorageCounter(meta=True) as math:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)  # meta alone: the math backend's T x T
    assert math.peak > 10 * cpu


def test_the_math_backend_and_graphs_keep_the_math_path():
    q, k, v = _qkv("meta")
    with TargetDevice("cuda"), math_backend(), StorageCounter(meta=True) as forced:
        F.scaled_dot_product_attention(q, k, v)
    q.requires_grad_()
    with TargetDevice("cuda"), StorageCounter(meta=True) as with_graph:
        F.scaled_dot_product_attention(q, k, v)
    fused = 2 * 4 * 512 * 16 * 4 + 2 * 4 * 512 * 4
    assert forced.peak > 10 * fused and with_graph.peak > 10 * fused
