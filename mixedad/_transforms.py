"""Where a call stands relative to torch.func transforms (vmap, grad, jvp, ...)."""
import torch


def in_functorch_transform():
    """True inside torch.func.vmap, grad, jvp, ... (where dual tensors cannot be used)."""
    return torch._C._functorch.maybe_current_level() is not None
