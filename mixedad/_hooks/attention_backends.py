"""Attention kernels with every derivative, for the passes that need double backward.

PyTorch's fused attention kernels (flash and memory-efficient SDPA, the fused
``nn.MultiheadAttention`` / ``TransformerEncoderLayer`` fast path) have neither forward-AD nor
double-backward formulas. The whole-G fallback, the reference and passes inside torch.func
transforms take the math backend and switch the fast path off; mixedad's own forward pass needs
neither, since its attention rule keeps the user's kernel for the primal, and torch leaves the
fast path whenever a torch-function mode is active.

What this relies on in torch (pinned by ``tests/_hooks/test_attention_backends.py``):

- ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)`` (``torch.backends.cuda.sdp_kernel`` before
  torch 2.3) restricts SDPA to the math backend for the block;
- ``torch.backends.mha.get_fastpath_enabled`` / ``set_fastpath_enabled`` switch the fast path
  process-wide (a flag, restored on exit);
- ``nn.MultiheadAttention`` takes no fast path while a ``TorchFunctionMode`` is active;
- ``torch.backends.cuda.flash_sdp_enabled()`` and ``mem_efficient_sdp_enabled()`` are False inside
  ``sdpa_kernel(SDPBackend.MATH)``;
- on the CPU, where ``torch._fused_sdp_choice`` answers ``SDPBackend.FLASH_ATTENTION``, SDPA
  calls ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``, whose first output is
  SDPA's output bit for bit and whose second is the log-sum-exp of each row of scores
  (:func:`fused_attention_with_lse`).
"""
import contextlib
import threading

import torch

from mixedad._hooks.autocast import cpu_autocast_on


@contextlib.contextmanager
def math_backend():
    """SDPA on the math backend for the block."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3
        with torch.backends.cuda.sdp_kernel(enable_flash=False, enable_math=True, enable_mem_efficient=False):
            yield
        return
    with sdpa_kernel(SDPBackend.MATH):
        yield


@contextlib.contextmanager
def no_fused_attention_layers():
    """The nn.MultiheadAttention / TransformerEncoderLayer fast path off; the flag restored on exit."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "get_fastpath_enabled"):
        yield
        return
    previous = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(previous)


@contextlib.contextmanager
def differentiable_attention():
    """Attention kernels with every derivative: math SDPA, and no MHA / encoder-layer fast path."""
    with math_backend(), no_fused_attention_layers():
        yield


def fused_attention_enabled():
    """Whether SDPA may take a fused kernel here (flash or memory-efficient), not only the math backend.

    Reads ``torch.backends.cuda.flash_sdp_enabled()`` and ``mem_efficient_sdp_enabled()``, the
    flags ``sdpa_kernel`` sets for every device (:func:`math_backend` turns both off).
    """
    return torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled()


def fused_attention_with_lse(query, key, value, attn_mask, is_causal, scale):
    r"""``(out, lse)`` from the kernel SDPA takes here, or None where it is not the CPU flash kernel.

    ``out`` is ``F.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal,
    scale)`` bit for bit, and ``lse`` the log-sum-exp of each row of scores,
    :math:`\log \sum_j \exp(S_{ij})` with :math:`S = \mathrm{scale}\,QK^\top + M`, of shape
    ``query.shape[:-1]`` in float32 or float64. Only for 4-d float32 / float64 CPU tensors with
    matching batch and head dimensions, and a floating (additive) mask or none: elsewhere SDPA
    may convert the mask, broadcast, or take another kernel, and None is returned. Meta tensors
    inside :func:`planning_for` ``("cpu")`` (a memory plan for the CPU) get the kernel's meta
    outputs where the CPU would take it.
    """
    if cpu_autocast_on():
        return None  # SDPA picks its dtype under autocast: the user's own call computes the primal
    tensors = (query, key, value)
    planned = all(t.device.type == "meta" for t in tensors) and getattr(_PLAN, "device", None) == "cpu"
    if any(type(t) is not torch.Tensor or (t.device.type != "cpu" and not planned) or t.dim() != 4
           or t.requires_grad for t in tensors):
        return None
    if query.dtype not in (torch.float32, torch.float64) or any(t.dtype != query.dtype for t in tensors):
        return None
    if not (query.shape[:2] == key.shape[:2] == value.shape[:2]):
        return None
    if attn_mask is not None and (type(attn_mask) is not torch.Tensor or attn_mask.dtype != query.dtype):
        return None
    choice = getattr(torch, "_fused_sdp_choice", None)
    kernel = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if choice is None or kernel is None:
        return None
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:  # torch < 2.3
        return None
    if planned:  # a memory plan for the CPU, on meta: where the CPU would take flash
        if not fused_kernel_would_run(query, key, value, attn_mask, "cpu"):
            return None
    elif choice(query, key, value, attn_mask, 0.0, is_causal, scale=scale) != int(SDPBackend.FLASH_ATTENTION.value):
        return None
    out, lse = kernel(query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
    return out, lse


def fused_kernel_would_run(query, key, value, attn_mask, device):
    """Whether SDPA on ``device`` ("cpu" or "cuda") would take a fused kernel for tensors of these sizes.

    For memory plans on meta tensors, where PyTorch's own choice cannot run. The conditions are
    those of the CPU's flash kernel (and a subset of CUDA's flash and memory-efficient ones): 4-d
    query, key and value with one batch and head count, one head dimension, unit stride in the
    last dimension, non-empty sequences, a mask of 2 or 4 dimensions or none, and a dtype the
    kernel takes (CUDA: no float64). Elsewhere the plan takes the math backend: high where the
    device would still fuse, never low.
    """
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return False
    if not (query.shape[:2] == key.shape[:2] == value.shape[:2]):
        return False
    if not (query.shape[-1] == key.shape[-1] == value.shape[-1]) or any(t.stride(-1) != 1 for t in tensors):
        return False
    if query.shape[-2] == 0 or key.shape[-2] == 0:
        return False
    if attn_mask is not None and (not isinstance(attn_mask, torch.Tensor) or attn_mask.dim() not in (2, 4)):
        return False
    dtypes = (torch.float16, torch.bfloat16, torch.float32) + ((torch.float64,) if device == "cpu" else ())
    return query.dtype in dtypes and all(t.dtype == query.dtype for t in tensors)


_PLAN = threading.local()


@contextlib.contextmanager
def planning_for(device):
    """Inside the block, :func:`fused_attention_with_lse` on meta tensors acts as ``device`` would (a memory plan)."""
    previous = getattr(_PLAN, "device", None)
    _PLAN.device = device
    try:
        yield
    finally:
        _PLAN.device = previous
