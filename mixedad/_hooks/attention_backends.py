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
- on the CPU, where ``torch._fused_sdp_choice`` answers ``SDPBackend.FLASH_ATTENTION``, SDPA's
  output lies in memory as ``(B, T, H, E)``; elsewhere it is contiguous (:func:`output_tokens_first`).
"""
import contextlib
import threading
import weakref

import torch

from mixedad._hooks.autocast import cpu_autocast_on
from mixedad._hooks.thread_local import setting


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


def blockwise_primal_here(query, key, value, attn_mask, is_causal=False, enable_gqa=False):
    """Whether mixedad's attention rule computes SDPA's primal in its own blocks here, not with the user's kernel.

    Yes for plain CPU tensors (or meta ones inside :func:`planning_for` ``("cpu")``, a memory plan
    for the CPU) that SDPA accepts (:func:`_sdpa_accepts`), outside CPU autocast (where SDPA picks
    its dtype) and with no graph to build through them. Elsewhere the user's kernel computes it,
    and raises where SDPA would.
    """
    if cpu_autocast_on():
        return False
    tensors = (query, key, value) + (() if attn_mask is None else (attn_mask,))
    planned = getattr(_PLAN, "device", None) == "cpu"
    grad = torch.is_grad_enabled()
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) or not (t.device.type == "cpu" or (planned and t.is_meta))
           or (grad and t.requires_grad) for t in tensors):
        return False
    return _sdpa_accepts(query, key, value, attn_mask, is_causal, enable_gqa)


def _sdpa_accepts(query, key, value, attn_mask, is_causal, enable_gqa):
    """The checks SDPA makes of its arguments' shapes and dtypes before it computes: one dtype, at least 2 dims,
    one head dimension for query and key, one length for key and value, batch dims that broadcast (heads
    grouped where ``enable_gqa``), a bool mask or one of the query's dtype, not beside ``is_causal``."""
    tensors = (query, key, value)
    if any(t.dim() < 2 or t.dtype != query.dtype for t in tensors) or query.shape[-1] == 0:
        return False
    if query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
        return False
    batches = [t.shape[:-2] for t in tensors]
    if enable_gqa:  # key and value heads repeated up to the query's
        if any(t.dim() < 3 for t in tensors) or any(t.shape[-3] == 0 or query.shape[-3] % t.shape[-3] for t in tensors):
            return False
        batches = [b[:-1] + (query.shape[-3],) for b in batches]
    try:
        batch = torch.broadcast_shapes(*batches)
        if attn_mask is not None:
            torch.broadcast_shapes(attn_mask.shape, (*batch, query.shape[-2], key.shape[-2]))
    except RuntimeError:
        return False
    return attn_mask is None or (not is_causal and attn_mask.dtype in (torch.bool, query.dtype))


def output_tokens_first(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    """Whether SDPA's output here lies in memory as ``(B, T, H, E)``, transposed to ``(B, H, T, E)``: where the CPU's
    flash kernel runs (4-d inputs it takes). Elsewhere (its math path) the output is contiguous. mixedad's blocks
    give their primal the same layout, so that G's later views see what a plain forward gives them."""
    if query.dim() != 4:
        return False
    if query.is_meta:  # a memory plan for the CPU
        return fused_kernel_would_run(query, key, value, attn_mask, "cpu", enable_gqa)
    choice = getattr(torch, "_fused_sdp_choice", None)
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:  # torch < 2.3
        return False
    if choice is None:
        return False
    try:
        picked = choice(query, key, value, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    except TypeError:  # no enable_gqa argument
        picked = choice(query, key, value, attn_mask, 0.0, is_causal, scale=scale)
    return picked == int(SDPBackend.FLASH_ATTENTION.value)


def meta_stand_in(mask):
    """A real mask, for a memory plan on meta tensors: a meta tensor of its shape and dtype that stands for it on the
    planned device (a mask G closes over, or one G makes from such a tensor as it runs).

    It holds one element (a stride-0 view) and keeps the real mask alive for as long as it lives itself: a mask that
    existed before the call is no allocation of it (and is counted nowhere), and one G made in the call is counted
    where it was made and lives as long as whatever keeps the stand-in (a graph that saves it) keeps it. What an op
    makes from it (a bool mask converted to an additive one) is allocated as on the device."""
    stand_in = torch.empty((), dtype=mask.dtype, device="meta")
    weakref.finalize(stand_in.untyped_storage(), _let_go, mask)
    return stand_in.expand(mask.shape)


def _let_go(mask):
    """Nothing: a finalizer that holds ``mask`` until the stand-in's storage goes."""


def fused_kernel_would_run(query, key, value, attn_mask, device, enable_gqa=False):
    """Whether SDPA on ``device`` ("cpu" or "cuda") would take a fused kernel for tensors of these sizes.

    For memory plans on meta tensors, where PyTorch's own choice cannot run. The conditions are
    those of the CPU's flash kernel (and a subset of CUDA's flash and memory-efficient ones): 4-d
    query, key and value with one batch and head count, one head dimension, unit stride in the
    last dimension, non-empty sequences, a mask of 2 or 4 dimensions or none, and a dtype the
    kernel takes (CUDA: no float64). Grouped heads (``enable_gqa``) where key and value have one head
    count that divides the query's: the CPU's flash kernel takes them (measured on torch 2.13;
    elsewhere it repeats them on the math backend), and so does CUDA's flash kernel, in float16 and
    bfloat16 without a mask and with a head dimension of at most 256; other grouped heads on CUDA are
    planned on the math backend. On CUDA the head dimension must also be a multiple of 8 (CUDA's
    memory-efficient kernel takes no other with a mask, nor in float32). The CUDA conditions were
    read off PyTorch's own choice (``torch._fused_sdp_choice``) on an H200 with torch 2.11
    (tests/test_cuda.py); a GPU older than Ampere has no flash kernel and runs grouped heads on the
    math backend. Elsewhere the plan takes the math backend: high where the device would still
    fuse, never low.
    """
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return False
    if not (query.shape[0] == key.shape[0] == value.shape[0]):
        return False
    heads = (query.shape[1], key.shape[1], value.shape[1])
    if not heads[0] == heads[1] == heads[2]:
        grouped = enable_gqa and heads[1] == heads[2] and heads[1] and heads[0] % heads[1] == 0
        flash = device == "cpu" or (attn_mask is None and query.dtype in (torch.float16, torch.bfloat16))
        if not (grouped and flash):
            return False
    if not (query.shape[-1] == key.shape[-1] == value.shape[-1]) or any(t.stride(-1) != 1 for t in tensors):
        return False
    if device == "cuda" and (query.shape[-1] % 8 or (heads[0] != heads[1] and query.shape[-1] > 256)):
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
    with setting(_PLAN, "device", device):
        yield
