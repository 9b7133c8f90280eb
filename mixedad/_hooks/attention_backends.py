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
  ``sdpa_kernel(SDPBackend.MATH)``.
"""
import contextlib

import torch


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
