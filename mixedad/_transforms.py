"""Where a call stands relative to torch.func transforms (vmap, grad, jvp, ...)."""
import torch


def in_functorch_transform():
    """True inside torch.func.vmap, grad, jvp, ... (where dual tensors cannot be used)."""
    return torch._C._functorch.maybe_current_level() is not None


def under_differentiating_transform():
    """True inside torch.func.grad, vjp, jacrev, jvp, jacfwd, ... (a transform that differentiates).

    Results computed there must keep the transform's tracking: ``detach()`` would cut it and
    the outer derivative would be silently zero.
    """
    if not in_functorch_transform():
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() in (TransformType.Grad, TransformType.Jvp) for i in retrieve_all_functorch_interpreters())


def under_vmap():
    """True inside torch.func.vmap (at any level)."""
    if not in_functorch_transform():
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters())
