r"""Fast tangent rules for frozen linear layers, used inside mixedad's forward-AD pass.

PyTorch's forward AD of linear, convolution and batch-norm kernels is general: it allows for
tangents of the weights and copies inputs along the way. Through a frozen generator the
weights have no tangent, and the JVP of each such layer is the layer itself, without bias:

.. math::

    \operatorname{linear}(x, W, b)\colon\ \dot y = \operatorname{linear}(\dot x, W) \qquad
    \operatorname{bn}_{\text{eval}}(x)\colon\ \dot y = \dot x \cdot \frac{\gamma}{\sqrt{\sigma^2 + \epsilon}}

A ``TorchFunctionMode`` intercepts ``F.linear``, ``F.conv{1,2,3}d``,
``F.conv_transpose{1,2,3}d`` and eval-mode ``F.batch_norm`` when the input carries a tangent
and the weights do not, computes primal and tangent with two plain calls, and returns them as a
dual tensor. Everything else (activations, train-mode normalisation, attention, weights that
carry tangents such as modulated convolutions) takes ordinary forward AD.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad
from torch.overrides import TorchFunctionMode

_WEIGHTED = {F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
_BATCH_NORM_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


def _tangent(x):
    # A Parameter never carries a tangent at mixedad's own dual level (only tensors computed
    # from z do), so it is answered without the unpacking call.
    if not isinstance(x, torch.Tensor) or isinstance(x, nn.Parameter):
        return None
    return forward_ad.unpack_dual(x).tangent


def _weighted(func, args, kwargs):
    if len(args) < 2 or _tangent(args[1]) is not None:
        return NotImplemented
    bias_in_args = len(args) > 2
    bias = args[2] if bias_in_args else kwargs.get("bias")
    x_tangent = _tangent(args[0])
    if x_tangent is None or _tangent(bias) is not None:
        return NotImplemented
    primal = func(forward_ad.unpack_dual(args[0]).primal, *args[1:], **kwargs)
    if bias_in_args:
        tangent = func(x_tangent, args[1], None, *args[3:], **kwargs)
    else:
        tangent = func(x_tangent, args[1], **{**kwargs, "bias": None})
    return forward_ad.make_dual(primal, tangent)


def _batch_norm_eval(args, kwargs):
    bound = dict(zip(_BATCH_NORM_ARGS, args), **kwargs)
    if bound.get("training", False):
        return NotImplemented
    x = bound.pop("input")
    x_tangent = _tangent(x)
    mean, var, weight = bound["running_mean"], bound["running_var"], bound.get("weight")
    if (x_tangent is None or mean is None or var is None
            or any(_tangent(t) is not None for t in (mean, var, weight, bound.get("bias")))):
        return NotImplemented
    primal = F.batch_norm(forward_ad.unpack_dual(x).primal, **bound)
    scale = torch.rsqrt(var + bound.get("eps", 1e-5))
    if weight is not None:
        scale = scale * weight
    return forward_ad.make_dual(primal, x_tangent * scale.reshape(1, -1, *([1] * (x_tangent.dim() - 2))))


class FrozenLayerRules(TorchFunctionMode):
    """Inside a forward-AD dual level: one plain call for the primal, one for the tangent."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = NotImplemented
        if func in _WEIGHTED:
            result = _weighted(func, args, kwargs)
        elif func is F.batch_norm:
            result = _batch_norm_eval(args, kwargs)
        return func(*args, **kwargs) if result is NotImplemented else result
