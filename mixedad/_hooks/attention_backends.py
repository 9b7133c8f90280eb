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


def blockwise_primal_here(query, key, value, attn_mask):
    """Whether mixedad's attention rule computes SDPA's primal in its own blocks here, not with the user's kernel.

    Yes for plain CPU tensors (or meta ones inside :func:`planning_for` ``("cpu")``, a memory plan
    for the CPU) that SDPA accepts (one dtype, one head dimension for query and key, a bool mask or
    one of the query's dtype), outside CPU autocast (where SDPA picks its dtype) and with no graph
    to build through them. Elsewhere the user's kernel computes it, and raises where SDPA would.
    """
    if cpu_autocast_on():
        return False
    tensors = (query, key, value)
    planned = getattr(_PLAN, "device", None) == "cpu"
    grad = torch.is_grad_enabled()
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) or not (t.device.type == "cpu" or (planned and t.is_meta))
           or (grad and t.requires_grad) for t in tensors):
        return False
    if any(t.dtype != query.dtype for t in tensors) or query.shape[-1] != key.shape[-1] or query.dim() < 2:
        return False
    return attn_mask is None or (type(attn_mask) is torch.Tensor and attn_mask.dtype in (torch.bool, query.dtype)
                                 and not (grad and attn_mask.requires_grad))


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
    """Inside the block, attention on meta tensors acts as on ``device`` (a memory plan): :func:`blockwise_primal_here`."""
    previous = getattr(_PLAN, "device", None)
    _PLAN.device = device
    try:
        yield
    finally:
        _PLAN.device = previous
