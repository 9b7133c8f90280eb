r"""Fast tangent rules for frozen linear layers, used inside mixedad's forward-AD pass.

PyTorch's forward AD of linear, convolution and batch-norm kernels is general: it allows for
tangents of the weights and copies inputs along the way. Through a frozen generator the
weights have no tangent, and the JVP of each such layer is the layer itself, without bias:

.. math::

    \operatorname{linear}(x, W, b)\colon\ \dot y = \operatorname{linear}(\dot x, W) \qquad
    \operatorname{bn}_{\text{eval}}(x)\colon\ \dot y = \dot x \cdot \frac{\gamma}{\sqrt{\sigma^2 + \epsilon}}

mixedad's op table (:mod:`mixedad.op_rules`) sends ``F.linear``, ``F.conv{1,2,3}d``,
``F.conv_transpose{1,2,3}d`` and eval-mode ``F.batch_norm`` here. When the input carries a
tangent and the weights do not, a rule computes primal and tangent with two plain calls and
returns them as a dual tensor; otherwise it declines (returns NotImplemented). Everything else (activations, train-mode normalisation, attention, weights that
carry tangents such as modulated convolutions) takes ordinary forward AD.

Kernels. The primal is always the user's own call, so ``G(z)`` comes out bit for bit as a plain
forward computes it. The tangent of a float32 ``F.linear`` on the CPU goes through oneDNN's
matrix product (``torch.ops.mkldnn._linear_pointwise``, the kernel PyTorch's CPU compiler
uses) where this build has it and ``torch.backends.mkldnn`` is enabled; eager ``F.linear``
calls the BLAS, which on some CPUs (MKL on AMD processors) runs at less than half oneDNN's
speed. The two agree to float32 round-off. ``torch.backends.mkldnn.flags(enabled=False)``
turns the oneDNN tangent off; float64 never takes it (oneDNN has no float64 kernels), and
neither does a pass under CPU autocast, where F.linear chooses the tangent's dtype as it does
the primal's.
"""
import functools

import torch
import torch.nn.functional as F
from torch import nn

from mixedad._duals import dual, tangent_of, unpack

WEIGHTED = {F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
_BATCH_NORM_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


@functools.lru_cache(maxsize=None)
def _onednn_linear_op():
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


def _cpu_autocast_on():
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4
        return torch.is_autocast_cpu_enabled()


def _linear_tangent(x_tangent, weight):
    r"""The tangent of a frozen linear layer, :math:`\dot y = \dot x W^\top`, on the fastest kernel."""
    if (x_tangent.dtype == torch.float32 and weight.dtype == torch.float32
            and x_tangent.device.type == "cpu" and weight.device.type == "cpu"
            and x_tangent.layout == torch.strided and weight.layout == torch.strided
            and type(x_tangent) is torch.Tensor and type(weight) in (torch.Tensor, nn.Parameter)
            and weight.dim() == 2 and weight.shape[1] > 0 and x_tangent.dim() >= 1  # oneDNN refuses K = 0
            and torch.backends.mkldnn.enabled
            and not _cpu_autocast_on()):  # under autocast, F.linear picks the dtype
        op = _onednn_linear_op()
        if op is not None:
            return op(x_tangent, weight, None, "none", [], "")
    return F.linear(x_tangent, weight)


def weighted_rule(call, func, args, kwargs):
    """Frozen linear or convolution: the primal call, and the same call on the tangent without bias."""
    if len(args) < 2 or tangent_of(args[1]) is not None:
        return NotImplemented
    bias_in_args = len(args) > 2
    bias = args[2] if bias_in_args else kwargs.get("bias")
    if not isinstance(args[0], torch.Tensor) or tangent_of(bias) is not None:
        return NotImplemented
    x_primal, x_tangent = unpack(args[0])
    if x_tangent is None:
        return NotImplemented
    primal = func(x_primal, *args[1:], **kwargs)
    if func is F.linear:
        tangent = _linear_tangent(x_tangent, args[1])
    elif bias_in_args:
        tangent = func(x_tangent, args[1], None, *args[3:], **kwargs)
    else:
        tangent = func(x_tangent, args[1], **{**kwargs, "bias": None})
    return dual(primal, tangent)


def batch_norm_eval_rule(call, func, args, kwargs):
    """Eval-mode batch norm with frozen statistics: the tangent is scaled per channel."""
    bound = dict(zip(_BATCH_NORM_ARGS, args), **kwargs)
    if bound.get("training", False):
        return NotImplemented
    x = bound.pop("input")
    mean, var, weight = bound["running_mean"], bound["running_var"], bound.get("weight")
    if not isinstance(x, torch.Tensor) or mean is None or var is None:
        return NotImplemented
    x_primal, x_tangent = unpack(x)
    if x_tangent is None or any(tangent_of(t) is not None for t in (mean, var, weight, bound.get("bias"))):
        return NotImplemented
    primal = F.batch_norm(x_primal, **bound)
    scale = torch.rsqrt(var + bound.get("eps", 1e-5))
    if weight is not None:
        scale = scale * weight
    shape = (1, -1, *([1] * (x_tangent.dim() - 2))) if x_tangent.dim() >= 2 else (-1,)
    return dual(primal, x_tangent * scale.reshape(shape))
