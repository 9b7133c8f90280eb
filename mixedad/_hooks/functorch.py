"""Where a call stands relative to torch.func transforms (vmap, grad, jvp, ...).

What this relies on in torch (pinned by ``tests/_hooks/test_functorch.py``):

- ``torch._C._functorch.maybe_current_level()`` is None outside every transform, and the
  innermost transform's level inside;
- ``torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters()`` lists the transforms
  in force, each with ``key()`` a ``torch._C._functorch.TransformType``;
- ``torch._C._functorch.is_functorch_wrapped_tensor(t)`` tells the transforms' tensors (batched
  or dual) from tensors captured from outside (a module's buffers).
"""
import torch


def current_level():
    """The innermost torch.func transform's level, or None outside every transform."""
    return torch._C._functorch.maybe_current_level()


def in_functorch_transform():
    """True inside torch.func.vmap, grad, jvp, ... (where dual tensors cannot be used)."""
    return current_level() is not None


def is_wrapped(t):
    """Whether ``t`` is a transform's tensor (batched or dual), not one captured from outside."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


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
