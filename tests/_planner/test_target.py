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


def test_the_math_backend_and_additive_masks_under_a_graph_keep_the_math_path():
    q, k, v = _qkv("meta")
    fused = 2 * 4 * 512 * 16 * 4 + 2 * 4 * 512 * 4
    with TargetDevice("cuda"), math_backend(), StorageCounter(meta=True) as forced:
        F.scaled_dot_product_attention(q, k, v)
    q.requires_grad_()
    mask = torch.empty(512, 512, device="meta")  # its rows may be masked by finfo.min, which meta cannot read
    with TargetDevice("cuda"), StorageCounter(meta=True) as with_mask:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert forced.peak > 10 * fused and with_mask.peak > 10 * fused


def _forward_and_backward(device):
    qkv = [torch.empty(2, 4, 512, 16, device="meta") if device == "meta" else torch.randn(2, 4, 512, 16)
           for _ in range(3)]
    for t in qkv:
        t.requires_grad_()

    def run():
        out = F.scaled_dot_product_attention(*qkv, is_causal=True)
        return torch.autograd.grad(out, qkv, torch.empty_like(out) if device == "meta" else torch.ones_like(out))

    return run


def test_a_graph_through_fused_attention_holds_what_the_cpu_kernel_holds():
    """input_grad's forward builds a graph through G's attention: the fused kernel saves its output and
    log-sum-exp (not the T x T scores), and its backward allocates one gradient per input."""
    _, cpu = cpu_peak_memory(_forward_and_backward("cpu"))
    run = _forward_and_backward("meta")
    with TargetDevice("cpu"), StorageCounter(meta=True) as planned:
        run()
    assert planned.peak == cpu


def test_the_output_takes_the_devices_layout():
    x = torch.empty(2, 64, 3, 4, 8, device="meta")
    q, k, v = x.permute(2, 0, 3, 1, 4)  # (B, H, T, E) views of a (B, T, 3, H, E) projection, as attention layers do
    with TargetDevice("cpu"):
        cpu = F.scaled_dot_product_attention(q, k, v)
    real = F.scaled_dot_product_attention(*torch.randn(2, 64, 3, 4, 8).permute(2, 0, 3, 1, 4))
    assert cpu.stride() == real.stride()  # the CPU's flash kernel: the query's layout
    with TargetDevice("cuda"):
        cuda = F.scaled_dot_product_attention(q.contiguous(), k, v)
    assert cuda.transpose(1, 2).is_contiguous()  # CUDA's kernels: tokens before heads
