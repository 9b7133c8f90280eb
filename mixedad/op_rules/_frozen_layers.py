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
import torch
import torch.nn.functional as F
from torch import nn

from mixedad._hooks.onednn import onednn_linear_op
from mixedad.op_rules._table import Path, defrule

_CONV = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_TRANSPOSE = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
_BATCH_NORM_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


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
        op = onednn_linear_op()
        if op is not None:
            return op(x_tangent, weight, None, "none", [], "")
    return F.linear(x_tangent, weight)


def _frozen_input(op, *frozen):
    """The input's tangent, when it has one and none of ``frozen`` does; else None."""
    if any(op.tangents.get(name) is not None for name in frozen):
        return None
    return op.tangents.get("input")


@defrule(Path.FROZEN, F.linear, reason="frozen weights", arguments=("input", "weight", "bias"), batched=True)
def linear_rule(op):
    """Frozen linear layer: the primal call, and the tangent through the fastest kernel.

    A batch of tangents is one more leading dimension, which ``F.linear`` takes as it is.
    """
    x_tangent = _frozen_input(op, "weight", "bias")
    if x_tangent is None:
        return NotImplemented
    return op.primal(), _linear_tangent(x_tangent, op.primals["weight"])


#: The number of dimensions of a convolution's input with a batch dimension, by op.
_CONV_DIMS = {F.conv1d: 3, F.conv2d: 4, F.conv3d: 5, F.conv_transpose1d: 3, F.conv_transpose2d: 4,
              F.conv_transpose3d: 5}


@defrule(Path.FROZEN, F.conv1d, F.conv2d, F.conv3d, reason="frozen weights", arguments=_CONV, batched=True)
@defrule(Path.FROZEN, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, reason="frozen weights",
         arguments=_CONV_TRANSPOSE, batched=True)
def convolution_rule(op):
    """Frozen (transposed) convolution: the primal call, and the same call on the tangent without bias.

    A batch of k tangents of an input with batch size B is one call with batch size k B.
    """
    x_tangent = _frozen_input(op, "weight", "bias")
    if x_tangent is None:
        return NotImplemented
    if not op.lowered:
        return op.primal(), op.primal(input=x_tangent, bias=None)
    primal = op.primal()
    if op.primals["input"].dim() < _CONV_DIMS.get(op.func, 0):  # unbatched input: k is the batch
        return primal, op.primal(input=x_tangent, bias=None)
    folded = op.primal(input=x_tangent.flatten(0, 1), bias=None)
    return primal, folded.unflatten(0, x_tangent.shape[:2])


@defrule(Path.FROZEN, F.batch_norm, reason="eval-mode statistics", arguments=_BATCH_NORM_ARGS, batched=True)
def batch_norm_eval_rule(op):
    """Eval-mode batch norm with frozen statistics: the tangent is scaled per channel."""
    bound = op.primals
    if bound.get("training", False) or bound.get("running_mean") is None or bound.get("running_var") is None:
        return NotImplemented
    x_tangent = _frozen_input(op, "running_mean", "running_var", "weight", "bias")
    if x_tangent is None:
        return NotImplemented
    scale = torch.rsqrt(bound["running_var"] + bound.get("eps", 1e-5))
    if bound.get("weight") is not None:
        scale = scale * bound["weight"]
    x_dim = op.primals["input"].dim()  # a batch of tangents adds a leading dimension
    shape = (1, -1, *([1] * (x_dim - 2))) if x_dim >= 2 else (-1,)
    return op.primal(), x_tangent * scale.reshape(shape)
