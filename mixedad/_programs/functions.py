r"""The tangent functions a tangent program calls: one per kind of layer or op, frozen weights.

Each takes the tangent ``t`` of the op's input (and the primal input ``x`` or output ``y`` where
the derivative needs it) and returns the tangent of the op's output, the same number forward
mode and double backward give through that op:

- linear layers (linear, convolutions, transposed convolutions): the layer on ``t`` without bias;
- eval batch norm: ``t`` times :math:`\gamma/\sqrt{\sigma^2_{\text{running}} + \epsilon}` per channel;
- normalisations over statistics of their input (batch norm in training mode, instance, group
  and layer norm): mixedad's batch-statistics tangent
  (:func:`mixedad.op_rules._frozen_layers._batch_statistics_tangent`) on the input viewed so that
  each normalised group is one channel of a batch norm;
- pointwise activations: PyTorch's own backward kernels, since their Jacobian is diagonal (the
  forward-mode formulas PyTorch uses are these same kernels).
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from mixedad._hooks.batch_norm import batch_norm_kernels, batch_norm_tangent, batch_norm_with_statistics
from mixedad.op_rules._attention import attention as attention_rule
from mixedad.op_rules._frozen_layers import _batch_statistics_tangent, _eval_scale, _linear_tangent, folded_weight

_CONV_TRANSPOSE = {nn.ConvTranspose1d: F.conv_transpose1d, nn.ConvTranspose2d: F.conv_transpose2d,
                   nn.ConvTranspose3d: F.conv_transpose3d}


def linear(t, weight):
    r""":math:`\dot y = \dot x W^\top`: run eagerly, on the kernel mixedad's per-op rule takes (oneDNN's on the CPU in
    float32); compiled, ``F.linear``, which the compiler lowers itself."""
    if torch.compiler.is_compiling():
        return F.linear(t, weight)
    return _linear_tangent(t, weight)


def conv(m, t, weight=None):
    """A frozen (transposed) convolution module's tangent: the module's convolution of ``t``, no bias
    (with ``weight`` in place of the module's, if given)."""
    weight = m.weight if weight is None else weight
    transpose = _CONV_TRANSPOSE.get(type(m))
    if transpose is not None:
        return transpose(t, weight, None, m.stride, m.padding, m.output_padding, m.groups, m.dilation)
    return m._conv_forward(t, weight, None)


def conv_batch_norm_eval(m, bn, t):
    r"""The tangent of an eval batch norm ``bn`` after the convolution ``m`` (exact ``nn.Conv*`` or
    ``nn.ConvTranspose*`` classes, one group), with the batch norm's scale folded into the weight:

    .. math::

        \operatorname{conv}(\dot x, W) \cdot s = \operatorname{conv}(\dot x, W s), \qquad
        s = \gamma / \sqrt{\sigma^2_{\text{running}} + \epsilon} \text{ per output channel,}

    one pass over the tangent fewer. Where the scaled weight would be the larger copy (a small batch),
    the convolution and then the scale; compiled, too (the compiler fuses the scale into the element-wise
    kernel after the convolution, where a scaled weight would cost kernels of its own on every call)."""
    weight = None if torch.compiler.is_compiling() else folded_weight(m, bn, t)
    if weight is None:
        return batch_norm_eval(bn, conv(m, t))
    return conv(m, t, weight)


def batch_norm_eval(m, t):
    """Eval batch norm (running statistics): the per-channel scale."""
    scale = _eval_scale(m.running_var, m.weight, m.eps)
    return t * scale.reshape(-1, *([1] * (t.dim() - 2))).to(t.dtype)


def _affine(out, weight):
    return out if weight is None else out * weight


def batch_norm_train(m, x, t):
    """Batch norm over the batch's own statistics (training mode, or no running statistics)."""
    return _batch_statistics_tangent(x, t, m.weight, m.eps)


#: The dtypes whose train-mode batch norm takes the kernels, as mixedad's per-op rule does (float16 and bfloat16 too:
#: PyTorch's forward-AD formula overflows there).
_KERNEL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def batch_norm_module_train(m, x, t):
    """``(m(x), tangent)`` of an exact ``nn.BatchNorm*`` over the batch's statistics: where ``m(x)`` is PyTorch's
    batch-norm kernel, that kernel called as ``nn.BatchNorm*.forward`` calls it (so the output and the running
    statistics are the module's own, bit for bit), and the tangent from the statistics it hands out
    (:func:`mixedad._hooks.batch_norm.batch_norm_tangent`, as mixedad's per-op rule); elsewhere ``m(x)`` and
    :func:`batch_norm_train`."""
    if not (batch_norm_kernels(x) and x.dtype in _KERNEL_DTYPES and t.dtype == x.dtype
            and t.shape == x.shape and x.dim() >= 2 and x.numel() > x.shape[1]):
        return m(x), batch_norm_train(m, x, t)
    m._check_input_dim(x)
    factor = 0.0 if m.momentum is None else m.momentum
    if m.training and m.track_running_stats and m.num_batches_tracked is not None:
        m.num_batches_tracked.add_(1)
        factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
    keep = not m.training or m.track_running_stats  # as the module: running statistics updated where it keeps them
    out, mean, invstd = batch_norm_with_statistics(x, m.weight, m.bias, m.running_mean if keep else None,
                                                   m.running_var if keep else None, factor, m.eps)
    return out, batch_norm_tangent(t, x, m.weight, mean, invstd, m.eps)


def instance_norm(m, x, t):
    """Instance norm over each sample's own statistics: a batch norm of N*C channels (C without a batch)."""
    if x.dim() == m._get_no_batch_dim():  # unbatched: (C, L...)
        return instance_norm(m, x.unsqueeze(0), t.unsqueeze(0)).squeeze(0)
    n, c = x.shape[0], x.shape[1]
    out = _batch_statistics_tangent(x.reshape(1, n * c, -1), t.reshape(1, n * c, -1), None, m.eps).reshape(x.shape)
    return _affine(out, None if m.weight is None else m.weight.reshape(-1, *([1] * (x.dim() - 2))))


def group_norm(m, x, t):
    """Group norm: a batch norm of N*groups channels, then the per-channel weight."""
    n = x.shape[0]
    out = _batch_statistics_tangent(x.reshape(1, n * m.num_groups, -1), t.reshape(1, n * m.num_groups, -1), None,
                                    m.eps).reshape(x.shape)
    return _affine(out, None if m.weight is None else m.weight.reshape(-1, *([1] * (x.dim() - 2))))


def layer_norm(m, x, t):
    """Layer norm over the last dimensions: a batch norm whose channels are the leading positions."""
    inner = math.prod(m.normalized_shape)
    rows = x.numel() // inner if inner else 0
    out = _batch_statistics_tangent(x.reshape(1, rows, inner), t.reshape(1, rows, inner), None, m.eps)
    return _affine(out.reshape(x.shape), m.weight)


def attention(q, k, v, dq, dk, dv, attn_mask, is_causal, scale, enable_gqa):
    """``(out, tangent)`` of ``F.scaled_dot_product_attention`` without dropout: mixedad's attention rule
    (:func:`mixedad.op_rules._attention.attention`), the user's kernel being SDPA itself."""
    options = {"attn_mask": attn_mask, "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}
    return attention_rule(lambda: F.scaled_dot_product_attention(q, k, v, **options), q, k, v, dq, dk, dv, **options)


def relu_in_place(x, params):
    return x.relu_()


def tanh_in_place(x, params):
    return x.tanh_()


def sigmoid_in_place(x, params):
    return x.sigmoid_()


def leaky_relu_in_place(x, params):
    return F.leaky_relu_(x, params["negative_slope"])


# Pointwise activations: (t, x, y, module or keyword values) -> tangent.
def relu(t, x, y, params):
    return torch.ops.aten.threshold_backward(t, y, 0)


def leaky_relu(t, x, y, params):
    slope = params["negative_slope"]
    if slope >= 0:
        return torch.ops.aten.leaky_relu_backward(t, y, slope, True)
    return torch.ops.aten.leaky_relu_backward(t, x, slope, False)


def tanh(t, x, y, params):
    return torch.ops.aten.tanh_backward(t, y)


def sigmoid(t, x, y, params):
    return torch.ops.aten.sigmoid_backward(t, y)


def gelu(t, x, y, params):
    return torch.ops.aten.gelu_backward(t, x, approximate=params["approximate"])


def silu(t, x, y, params):
    return torch.ops.aten.silu_backward(t, x)


def elu(t, x, y, params):
    return torch.ops.aten.elu_backward(t, params["alpha"], 1.0, 1.0, False, x)


def softplus(t, x, y, params):
    return torch.ops.aten.softplus_backward(t, x, params["beta"], params["threshold"])


def hardtanh(t, x, y, params):
    return torch.ops.aten.hardtanh_backward(t, x, params["min_val"], params["max_val"])


def absolute(t, x, y, params):
    return t * x.sgn()


def exp(t, x, y, params):
    return t * y


def sqrt(t, x, y, params):
    return t / (2 * y)


def rsqrt(t, x, y, params):
    return t * (-0.5 * y * y * y)


def power(t, x, y, params):
    """``x ** c`` with a constant exponent c."""
    c = params["exponent"]
    if c == 0:
        return torch.zeros_like(t)
    return t * (c * x.pow(c - 1))


# Sums, products and quotients; tangents of constants are None.
def like(t, out):
    """``t`` broadcast to the output's shape and dtype (a tangent of a broadcast operand)."""
    if t.shape != out.shape:
        t = t.expand(out.shape)
    return t if t.dtype == out.dtype else t.to(out.dtype)


def add(out, ta, tb, alpha=1):
    """The tangent of ``a + alpha b``."""
    if tb is not None and alpha != 1:
        tb = tb * alpha
    if ta is None:
        return like(tb, out)
    if tb is None:
        return like(ta, out)
    return like(ta + tb, out)


def sub(out, ta, tb, alpha=1):
    """The tangent of ``a - alpha b``."""
    return add(out, ta, None if tb is None else -tb, alpha)


def mul(out, a, b, ta, tb):
    """The tangent of ``a * b``: :math:`\\dot a b + a \\dot b`."""
    first = None if ta is None else ta * b
    second = None if tb is None else a * tb
    return add(out, first, second)


def div(out, a, b, ta, tb):
    """The tangent of ``a / b``: :math:`\\dot a / b - (a / b)\\,\\dot b / b`."""
    first = None if ta is None else ta / b
    second = None if tb is None else -(out * tb / b)
    return add(out, first, second)


def matmul(out, a, b, ta, tb):
    """The tangent of ``a @ b``."""
    first = None if ta is None else torch.matmul(ta, b)
    second = None if tb is None else torch.matmul(a, tb)
    return add(out, first, second)


def bias(t, spatial):
    """The tangent of a bias, shaped to broadcast as ``F.linear`` (``spatial`` 0: the last dimension) or an
    ``F.conv*`` over ``spatial`` dimensions (the channels, batched or not) adds it."""
    if t is None or not spatial:
        return t
    return t.reshape(-1, *([1] * spatial))


def addmm(out, m1, m2, t_in, t1, t2, beta, alpha):
    """The tangent of ``torch.addmm(input, m1, m2, beta=beta, alpha=alpha)``."""
    product = matmul(out, m1, m2, t1, t2) if t1 is not None or t2 is not None else None
    scaled_in = None if t_in is None else t_in * beta
    return add(out, scaled_in, None if product is None else product * alpha)


def joined(how, primals, tangents, dim):
    """The tangent of ``torch.cat`` (``how="cat"``) or ``torch.stack`` of ``primals``: zeros where a part is constant."""
    if tangents is None:
        tangents = [None] * len(primals)
    parts = [torch.zeros_like(p) if t is None else like(t, p) for p, t in zip(primals, tangents)]
    return torch.cat(parts, dim) if how == "cat" else torch.stack(parts, dim)


def where(out, condition, ta, tb, a, b):
    """The tangent of ``torch.where(condition, a, b)``."""
    zero = torch.zeros((), dtype=out.dtype, device=out.device)
    return like(torch.where(condition, zero if ta is None else ta, zero if tb is None else tb), out)


def constant(out):
    """The tangent of an output of G that does not depend on z: zeros, or None where it is not a float tensor."""
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        return torch.zeros_like(out)
    return None


def relu_tangent_in_place(t, x, y, params):
    return torch.ops.aten.threshold_backward.grad_input(t, y, 0, grad_input=t)


def tanh_tangent_in_place(t, x, y, params):
    return torch.ops.aten.tanh_backward.grad_input(t, y, grad_input=t)


def sigmoid_tangent_in_place(t, x, y, params):
    return torch.ops.aten.sigmoid_backward.grad_input(t, y, grad_input=t)


def leaky_relu_tangent_in_place(t, x, y, params):
    return torch.ops.aten.leaky_relu_backward.grad_input(t, y, params["negative_slope"], True, grad_input=t)


#: Activations whose tangent reads their output alone (leaky ReLU: a slope of at least 0), by tangent function:
#: ``(primal in place, tangent in place)``. A program runs the first where it may overwrite the activation's input
#: (a tensor of its own that nothing else reads), the second where it may overwrite the incoming tangent. The
#: same kernels as the out-of-place calls, so the same numbers.
IN_PLACE = {relu: (relu_in_place, relu_tangent_in_place), tanh: (tanh_in_place, tanh_tangent_in_place),
            sigmoid: (sigmoid_in_place, sigmoid_tangent_in_place),
            leaky_relu: (leaky_relu_in_place, leaky_relu_tangent_in_place)}
#: Tangent functions whose result is a tensor of their own, never a view of their input or the input itself.
FRESH = frozenset({conv, conv_batch_norm_eval, batch_norm_eval, linear, relu, leaky_relu, tanh, sigmoid, gelu, silu,
                   elu, softplus, hardtanh, *(pair[1] for pair in IN_PLACE.values())})
