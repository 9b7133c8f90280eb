"""Batch norm's own kernels, for the tangent of batch norm over the batch's statistics.

What this relies on in torch (pinned by ``tests/_hooks/test_batch_norm.py``):

- on the CPU (and on meta tensors), ``F.batch_norm`` computes ``torch.native_batch_norm`` bit for
  bit, and that call also returns the batch mean and inverse standard deviation it used;
- ``torch.ops.aten.native_batch_norm_backward(g, x, weight, None, None, mean, invstd, True, eps,
  [True, False, False])[0]`` is :math:`s\\,(g - \\bar g - \\hat x\\, \\overline{g \\hat x})` per
  channel, the gradient in the input, which is also the tangent: the Jacobian of batch norm in
  its input is symmetric.

On other devices ``F.batch_norm`` may take another kernel (cuDNN), so :func:`batch_norm_kernels`
says whether these apply.

Also relied on: of the buffers of ``torch.nn``'s own layers, only the batch and instance norms'
``num_batches_tracked`` (``torch.nn.modules.batchnorm._NormBase``) goes unread by a forward in eval
mode (:func:`read_in_eval`).
"""
import torch
from torch.nn.modules.batchnorm import _NormBase

from mixedad._hooks.autocast import cpu_autocast_on

__all__ = ["batch_norm_kernels", "batch_norm_with_statistics", "batch_norm_tangent", "read_in_eval"]


def batch_norm_kernels(x):
    """Whether ``F.batch_norm`` on ``x`` is ``torch.native_batch_norm`` (the CPU and meta tensors, autocast off)."""
    return (x.device.type in ("cpu", "meta") and type(x) is torch.Tensor and x.layout == torch.strided
            and not cpu_autocast_on())


def batch_norm_with_statistics(x, weight, bias, running_mean, running_var, momentum, eps):
    """``F.batch_norm(..., training=True)`` and the batch's (mean, invstd): one call of the kernel it takes."""
    return torch.native_batch_norm(x, weight, bias, running_mean, running_var, True, momentum, eps)


def batch_norm_tangent(x_tangent, x, weight, mean, invstd, eps):
    """The tangent of training-mode batch norm at ``x`` along ``x_tangent``, by its backward kernel."""
    return torch.ops.aten.native_batch_norm_backward(x_tangent, x, weight, None, None, mean, invstd, True, eps,
                                                     [True, False, False])[0]


def read_in_eval(module, name):
    """Whether a forward in eval mode of ``module``, one of ``torch.nn``'s own layers, reads its buffer ``name``."""
    return not (isinstance(module, _NormBase) and name == "num_batches_tracked")
