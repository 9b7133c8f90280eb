r"""Fast tangent rules for frozen linear layers, used inside mixedad's forward-AD pass.

PyTorch's forward AD of linear, convolution and batch-norm kernels is general: it allows for
tangents of the weights and copies inputs along the way. Through a frozen generator the
weights have no tangent, and the JVP of each such layer is the layer itself, without bias:

.. math::

    \operatorname{linear}(x, W, b)\colon\ \dot y = \operatorname{linear}(\dot x, W) \qquad
    \operatorname{bn}_{\text{eval}}(x)\colon\ \dot y = \dot x \cdot \frac{\gamma}{\sqrt{\sigma^2 + \epsilon}}

and batch norm over the batch's own statistics (training mode) has a short written tangent
(:func:`_batch_statistics_tangent`; on the CPU, batch norm's own backward kernel, since its
Jacobian in the input is symmetric). mixedad's op table (:mod:`mixedad.op_rules`) sends
``F.linear``, ``F.conv{1,2,3}d``, ``F.conv_transpose{1,2,3}d`` and ``F.batch_norm`` here. When the input carries a
tangent and the weights do not, a rule computes primal and tangent with two plain calls and
returns them as a dual tensor; otherwise it declines (returns NotImplemented). Everything else (activations, other normalisations, attention, weights that
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
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from mixedad._hooks.autocast import cpu_autocast_on
from mixedad._hooks.batch_norm import batch_norm_kernels, batch_norm_tangent, batch_norm_with_statistics
from mixedad._hooks.onednn import onednn_linear_op
from mixedad._hooks.sequential import forward_hooks, running_child
from mixedad._ground.errors import OpRuleError
from mixedad.op_rules._table import Path, defrule

_CONV = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_TRANSPOSE = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
_BATCH_NORM_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


def _linear_tangent(x_tangent, weight):
    r"""The tangent of a frozen linear layer, :math:`\dot y = \dot x W^\top`, on the fastest kernel."""
    if (x_tangent.dtype == torch.float32 and weight.dtype == torch.float32
            and x_tangent.device.type == "cpu" and weight.device.type == "cpu"
            and x_tangent.layout == torch.strided and weight.layout == torch.strided
            and type(x_tangent) is torch.Tensor and type(weight) in (torch.Tensor, nn.Parameter)
            and weight.dim() == 2 and weight.shape[1] > 0 and x_tangent.dim() >= 1  # oneDNN refuses K = 0
            and torch.backends.mkldnn.enabled
            and not cpu_autocast_on()):  # under autocast, F.linear picks the dtype
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
        fold = _fold(op)
        if fold is not None:
            folded, batch_norm = fold
            del fold
            # The tangent first, and the folded weight freed before the primal: the copy never adds to the peak.
            tangent = op.primal(input=x_tangent, weight=folded, bias=None)
            del folded
            primal = op.primal()
            if tangent.stride() != primal.stride():
                # A dual tensor keeps a tangent of the primal's layout, copying one that differs: copy it here, so
                # that the BatchNorm finds this very tensor.
                tangent = torch.empty_strided(primal.shape, primal.stride(), dtype=tangent.dtype,
                                              device=tangent.device).copy_(tangent)
            _FOLD.pending = (weakref.ref(tangent), weakref.ref(batch_norm.running_var))
            return primal, tangent
        return op.primal(), op.primal(input=x_tangent, bias=None)
    primal = op.primal()
    if op.primals["input"].dim() < _CONV_DIMS.get(op.func, 0):  # unbatched input: k is the batch
        return primal, op.primal(input=x_tangent, bias=None)
    folded = op.primal(input=x_tangent.flatten(0, 1), bias=None)
    return primal, folded.unflatten(0, x_tangent.shape[:2])


@defrule(Path.FROZEN, F.batch_norm, reason="frozen affine, statistics written out", arguments=_BATCH_NORM_ARGS,
         batched=True)
def batch_norm_rule(op):
    """Batch norm with frozen weights: running statistics (eval) or the batch's own (training).

    Eval mode scales the tangent per channel. With batch statistics (``training=True``, which
    ``nn.BatchNorm*`` also passes without running statistics) see :func:`_batch_statistics_tangent`.
    The primal is the user's call, so running statistics are updated as a plain forward updates them.
    """
    bound = op.primals
    x_tangent = _frozen_input(op, "running_mean", "running_var", "weight", "bias")
    if x_tangent is None:
        return NotImplemented
    x = bound["input"]
    eps = bound.get("eps", 1e-5)
    if bound.get("training", False):
        kernels = batch_norm_kernels(x) and not op.lowered and x_tangent.shape == x.shape
        reduced = x.dtype in (torch.float16, torch.bfloat16)
        if (x.dim() < 2 or (x.dtype not in (torch.float32, torch.float64) and not (reduced and kernels))
                or x_tangent.dtype != x.dtype or x.numel() <= x.shape[1] or cpu_autocast_on()):
            # Autocast (PyTorch's formula computes as the kernel does), or one value per channel or none:
            # F.batch_norm's own checks and paths (it raises for one value per channel).
            return NotImplemented
        if kernels:
            # The user's call is this kernel here (bit for bit), and it hands out the statistics it used. In
            # float16 and bfloat16 too: its backward kernel is double backward's own, where PyTorch's forward-AD
            # formula overflows to NaN (float16, inputs of size 0.01: a review found it).
            out, mean, invstd = batch_norm_with_statistics(x, bound.get("weight"), bound.get("bias"),
                                                           bound.get("running_mean"), bound.get("running_var"),
                                                           bound.get("momentum", 0.1), eps)
            return out, batch_norm_tangent(x_tangent, x, bound.get("weight"), mean, invstd, eps)
        return op.primal(), _batch_statistics_tangent(x, x_tangent, bound.get("weight"), eps, batched=op.lowered)
    if bound.get("running_mean") is None or bound.get("running_var") is None:
        return NotImplemented  # eval mode without running statistics: F.batch_norm raises, as it should
    if _folded_into(x_tangent, bound):
        return op.primal(), x_tangent  # the convolution before applied the scale
    return op.primal(), x_tangent * _eval_scale(bound["running_var"], bound.get("weight"), eps).reshape(
        _channel_shape(x.dim()))


def _eval_scale(running_var, weight, eps):
    r"""Eval batch norm's per-channel factor, :math:`\gamma / \sqrt{\sigma^2_{\text{running}} + \epsilon}`."""
    scale = torch.rsqrt(running_var + eps)
    return scale if weight is None else scale * weight


#: The exact module classes whose calls a fold may span (a subclass may do more in its forward).
_CONVOLUTIONS = {nn.Conv1d: 0, nn.Conv2d: 0, nn.Conv3d: 0, nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 1,
                 nn.ConvTranspose3d: 1}  # class: the weight's output-channel dimension
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
#: A fold copies the convolution's weight, scaled: only where that copy is at most this fraction
#: (its inverse) of the input's tangent, so that it never sets a pass's peak memory (a latent-to-map
#: layer, or a wide layer at a small batch, keeps the scaling pass instead).
FOLD_RATIO = 16
_FOLD = threading.local()  # pending: weak references to the last folded tangent and its BatchNorm's running_var


def _fold(op):
    r"""``(weight, batch_norm)``: the convolution's weight with the next eval BatchNorm's scale folded in; or None.

    .. math::

        \operatorname{bn}_{\text{eval}}(\operatorname{conv}(\dot x, W)) \text{'s tangent} =
        \operatorname{conv}(\dot x, W \cdot s), \qquad s = \gamma / \sqrt{\sigma^2 + \epsilon}
        \text{ per output channel}

    saves the pass that scales the tangent. Only where the convolution's output can reach nothing
    but that BatchNorm: the call is an exact ``nn.Conv*`` / ``nn.ConvTranspose*`` module (one
    group, batched input) run by an ``nn.Sequential`` (its own iteration) whose next child is an
    exact ``nn.BatchNorm*`` in eval mode with running statistics, neither module has its forward
    replaced on the instance, neither module nor the process has forward hooks, and the weight is
    small beside the input (:data:`FOLD_RATIO`). The
    BatchNorm's rule then finds this very tangent (by identity) and passes it on unscaled.
    """
    if cpu_autocast_on():  # the convolution's dtype is autocast's choice, the BatchNorm's another
        return None
    found = running_child()
    if found is None:
        return None
    sequential, conv = found
    dim = _CONVOLUTIONS.get(type(conv))
    if dim is None or conv.weight is not op.primals["weight"] or conv.groups != 1:
        return None
    if op.primals["input"].dim() != _CONV_DIMS.get(op.func):  # unbatched: channels at 0, a BatchNorm's at 1
        return None
    if type(sequential).__iter__ is not nn.Sequential.__iter__:  # the Sequential runs its own children
        return None
    children = list(sequential._modules.values())
    at = [i for i, child in enumerate(children) if child is conv]
    if len(at) != 1 or at[0] + 1 == len(children):
        return None
    bn = children[at[0] + 1]
    if (type(bn) not in _BATCH_NORMS or bn.training or not bn.track_running_stats or bn.running_var is None
            or bn.running_mean is None or forward_hooks(conv, bn)
            or "forward" in vars(conv) or "forward" in vars(bn)):  # a forward replaced on the instance
        return None
    weight = folded_weight(conv, bn, op.tangents["input"])
    return None if weight is None else (weight, bn)


def folded_weight(conv, bn, x_tangent):
    r"""``conv``'s weight times eval ``bn``'s scale per output channel (``conv`` an exact ``nn.Conv*`` or
    ``nn.ConvTranspose*`` of one group), or None: where the two do not match (channels, dtype), or where
    the copy would cost more memory than the scaling pass over ``x_tangent`` it saves (:data:`FOLD_RATIO`).

    .. math::

        \operatorname{bn}(\operatorname{conv}(\dot x, W)) \text{'s tangent} = \operatorname{conv}(\dot x,\ W s),
        \qquad s = \gamma / \sqrt{\sigma^2_{\text{running}} + \epsilon}
    """
    if conv.weight.numel() * FOLD_RATIO > x_tangent.numel():
        return None
    dim = _CONVOLUTIONS[type(conv)]
    scale = _eval_scale(bn.running_var, bn.weight, bn.eps)
    if scale.shape[0] != conv.weight.shape[dim] or scale.dtype != conv.weight.dtype:
        return None
    shape = [1] * conv.weight.dim()
    shape[dim] = -1
    return conv.weight * scale.reshape(shape)


def _folded_into(x_tangent, bound):
    """Whether ``x_tangent`` is the tangent a convolution computed with this BatchNorm's scale folded in.

    Raises:
        OpRuleError: the convolution before folded this BatchNorm's scale into its tangent, and a
            different tensor arrived here (never expected: refused rather than scaled twice).
    """
    pending = getattr(_FOLD, "pending", None)
    if pending is None:
        return False
    tangent, running_var = pending[0](), pending[1]()
    if tangent is x_tangent:
        _FOLD.pending = None
        return True
    mine = bound.get("running_var")  # the dispatch hands rules an alias of the buffer: compare storage, not objects
    if running_var is not None and isinstance(mine, torch.Tensor) and mine.is_set_to(running_var):
        _FOLD.pending = None
        raise OpRuleError("mixedad: the convolution before a BatchNorm folded the BatchNorm's scale into its "
                          "tangent, and another tensor reached the BatchNorm; please report this with G's code")
    return False


def forget_folds():
    """Drop a fold that a pass which stopped early left pending (each pass starts with none)."""
    _FOLD.pending = None


def _channel_shape(dim):
    """The shape that broadcasts a per-channel vector over an input of ``dim`` dimensions (channels at 1)."""
    return (1, -1, *([1] * (dim - 2))) if dim >= 2 else (-1,)


def _batch_statistics_tangent(x, x_tangent, weight, eps, *, batched=False):
    r"""The tangent of batch norm over the batch's own statistics, with frozen weight and bias.

    With :math:`\mu, \sigma^2` the mean and biased variance per channel over the batch and the
    spatial dimensions, :math:`\hat x = (x - \mu)/\sqrt{\sigma^2 + \epsilon}` and
    :math:`s = \gamma / \sqrt{\sigma^2 + \epsilon}`:

    .. math::

        \dot y = s\,\big(\dot x - \overline{\dot x} - \hat x\, \overline{\dot x \hat x}\big)

    (bars: means per channel). :math:`\hat x` and the statistics come from one call of batch
    norm's own kernel without weights (a channel-wise reduction, much faster than ``var_mean``
    over the batch and spatial dimensions), then two reductions of the tangent and two fused
    multiply-adds, where PyTorch's general formula takes about twenty ops. With ``batched`` the
    tangent carries a leading dimension of k tangents, each reduced on its own.
    """
    dims = [0, *range(2, x.dim())]
    x_hat, _, invstd = batch_norm_with_statistics(x, None, None, None, None, 0.0, eps)
    scale = invstd.reshape(_channel_shape(x.dim()))
    if weight is not None:
        scale = scale * weight.reshape(_channel_shape(x.dim()))
    tangent_dims = [d + 1 for d in dims] if batched else dims
    tangent_mean = x_tangent.mean(dim=tangent_dims, keepdim=True)
    projection = (x_tangent * x_hat).mean(dim=tangent_dims, keepdim=True)
    out = torch.addcmul(tangent_mean.mul_(scale).neg_(), x_tangent, scale)  # s (x_tangent - mean(x_tangent))
    return out.addcmul_(x_hat, projection.mul_(scale).neg_())  # - s x_hat mean(x_tangent x_hat)
