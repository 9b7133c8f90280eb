r"""StyleGAN2-ADA-style custom ops: ``autograd.Function``\ s with forward and backward, no ``jvp``.

NVlabs' ``bias_act``, ``upfirdn2d`` and ``fma`` are written this way: a fused forward and a
backward that is itself written in differentiable ops (StyleGAN trains with R1 and path-length
penalties, which need double backward). They have no forward-AD formula, so PyTorch's forward
mode cannot pass them; mixedad's local rule (:mod:`mixedad.op_rules._local`) can. These are
mixedad's own implementations of the same maths, in plain torch ops, for tests, benchmarks and
the zoo.

.. math::

    \mathrm{bias\_act}(x, b) = g \cdot \mathrm{lrelu}_\alpha(x + b), \qquad
    \mathrm{fma}(a, b, c) = a b + c, \qquad
    \mathrm{upfirdn2d}(x, f) = \downarrow_d\big(f \star \mathrm{pad}(\uparrow_u x)\big)
"""
import math

import torch
import torch.nn.functional as F

__all__ = ["bias_act", "fma", "upfirdn2d", "setup_filter"]


def _unbroadcast(grad, shape):
    """Sum ``grad`` down to ``shape`` (the inverse of broadcasting)."""
    extra = grad.dim() - len(shape)
    if extra > 0:
        grad = grad.sum(dim=tuple(range(extra)))
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


class _BiasAct(torch.autograd.Function):
    """Bias, leaky ReLU and gain in one op; the backward is differentiable."""

    @staticmethod
    def forward(ctx, x, b, alpha, gain):
        pre = x + b.reshape(1, -1, *([1] * (x.dim() - 2)))
        ctx.save_for_backward(pre)
        ctx.alpha, ctx.gain = alpha, gain
        return F.leaky_relu(pre, alpha) * gain

    @staticmethod
    def backward(ctx, grad):
        (pre,) = ctx.saved_tensors
        slope = torch.where(pre > 0, torch.ones_like(pre), torch.full_like(pre, ctx.alpha))
        dx = grad * slope * ctx.gain
        return dx, dx.sum(dim=[d for d in range(dx.dim()) if d != 1]), None, None


class _FusedMultiplyAdd(torch.autograd.Function):
    """``a * b + c`` with broadcasting, as StyleGAN2-ADA's ``fma``."""

    @staticmethod
    def forward(ctx, a, b, c):
        ctx.save_for_backward(a, b)
        ctx.c_shape = c.shape
        return torch.addcmul(c, a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return _unbroadcast(grad * b, a.shape), _unbroadcast(grad * a, b.shape), _unbroadcast(grad, ctx.c_shape)


def _upsample_zeros(x, up):
    if up == 1:
        return x
    n, c, h, w = x.shape
    x = x.reshape(n, c, h, 1, w, 1)
    x = F.pad(x, [0, up - 1, 0, 0, 0, up - 1])
    return x.reshape(n, c, h * up, w * up)


def _filter_weight(f, channels):
    return f.flip([0, 1])[None, None].repeat(channels, 1, 1, 1)


class _UpFirDn2d(torch.autograd.Function):
    """Upsample by zero insertion, pad, FIR filter, downsample; the backward is its adjoint."""

    @staticmethod
    def forward(ctx, x, f, up, down, pad, gain):
        ctx.save_for_backward(f)
        ctx.up, ctx.down, ctx.pad, ctx.gain, ctx.x_shape = up, down, pad, gain, x.shape
        y = F.pad(_upsample_zeros(x, up), [pad[0], pad[1], pad[2], pad[3]])
        ctx.padded_shape = y.shape
        y = F.conv2d(y, _filter_weight(f, x.shape[1]) * gain, groups=x.shape[1])
        ctx.filtered_shape = y.shape
        return y[:, :, ::down, ::down]

    @staticmethod
    def backward(ctx, grad):
        (f,) = ctx.saved_tensors
        n, c, h, w = ctx.x_shape
        g = grad
        if ctx.down > 1:  # adjoint of striding: scatter back into zeros
            g = grad.new_zeros(ctx.filtered_shape)
            g[:, :, ::ctx.down, ::ctx.down] = grad
        g = F.conv_transpose2d(g, _filter_weight(f, c) * ctx.gain, groups=c)  # adjoint of the filter
        ph, pw = ctx.padded_shape[2], ctx.padded_shape[3]
        g = g[:, :, ctx.pad[2]:ph - ctx.pad[3], ctx.pad[0]:pw - ctx.pad[1]]  # adjoint of padding
        return g[:, :, ::ctx.up, ::ctx.up], None, None, None, None, None


def setup_filter(taps=(1, 3, 3, 1), dtype=torch.float32, device="cpu"):
    """A separable 2-D FIR filter from 1-D taps, normalised to sum 1 (StyleGAN's [1, 3, 3, 1])."""
    f = torch.tensor(taps, dtype=dtype, device=device)
    f = f[:, None] * f[None, :]
    return f / f.sum()


def bias_act(x, b, *, alpha=0.2, gain=math.sqrt(2)):
    """``gain * leaky_relu(x + b, alpha)``, b broadcast along dim 1; a custom Function without jvp."""
    return _BiasAct.apply(x, b, alpha, gain)


def fma(a, b, c):
    """``a * b + c``; a custom Function without jvp."""
    return _FusedMultiplyAdd.apply(a, b, c)


def upfirdn2d(x, f, *, up=1, down=1, padding=(0, 0, 0, 0), gain=1.0):
    """Upsample by ``up``, pad (left, right, top, bottom), filter with f, downsample by ``down``."""
    return _UpFirDn2d.apply(x, f, up, down, tuple(padding), gain)
