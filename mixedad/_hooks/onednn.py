"""oneDNN's linear kernel, for the float32 tangent of a frozen ``F.linear`` on the CPU.

What this relies on in torch (pinned by ``tests/_hooks/test_onednn.py``): where the build has
it, ``torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")`` computes ``F.linear(x, w, b)``
(it is the kernel PyTorch's CPU compiler uses). It is probed once on fixed inputs and used only
if it agrees; otherwise :func:`onednn_linear_op` returns None and the tangent takes ``F.linear``.
"""
import functools

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=None)
def onednn_linear_op():
    """``torch.ops.mkldnn._linear_pointwise`` if this build has it and it computes F.linear, else None.

    Probed once on fixed (not random) inputs, so the user's RNG is never touched.
    """
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return None
    # Explicit dtype and device: the probe must not follow a default dtype or device the user set.
    x = torch.linspace(-1.0, 1.0, 24, dtype=torch.float32, device="cpu").reshape(2, 3, 4)
    w = torch.linspace(0.5, -0.5, 20, dtype=torch.float32, device="cpu").reshape(5, 4)
    try:
        with torch.no_grad():
            ok = torch.allclose(op(x, w, None, "none", [], ""), F.linear(x, w), rtol=1e-5, atol=1e-6)
    except (RuntimeError, NotImplementedError):
        return None
    return op if ok else None
