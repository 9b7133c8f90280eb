"""Zoo member: a StyleGAN2-ADA-like generator built from custom Functions without ``jvp``."""
import math

import torch
from torch import nn

from mixedad.zoo._build import finish, seeded
from mixedad.zoo._custom_ops import bias_act, fma, setup_filter, upfirdn2d


class _FullyConnected(nn.Module):
    """StyleGAN2-ADA's FullyConnectedLayer: matmul, then ``bias_act``."""

    def __init__(self, cin, cout):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cout, cin) / math.sqrt(cin))
        self.bias = nn.Parameter(torch.zeros(cout))

    def forward(self, x):
        return bias_act(x @ self.weight.t(), self.bias)


class _SynthesisLayer(nn.Module):
    """Modulated 3x3 convolution on the non-fused path (``x * style``, conv, ``fma`` with noise).

    ``up=2`` upsamples first with ``upfirdn2d`` (zero insertion and the [1, 3, 3, 1] FIR filter).
    Noise is a fixed buffer (``noise_mode='const'``), so G is deterministic.
    """

    def __init__(self, cin, cout, w_dim, resolution, up=1):
        super().__init__()
        self.affine = nn.Linear(w_dim, cin)
        nn.init.ones_(self.affine.bias)
        self.weight = nn.Parameter(torch.randn(cout, cin, 3, 3))
        self.bias = nn.Parameter(torch.zeros(cout))
        self.noise_strength = nn.Parameter(torch.full((), 0.1))
        self.register_buffer("noise_const", torch.randn(resolution, resolution))
        self.register_buffer("fir", setup_filter())
        self.up = up

    def forward(self, x, w):
        styles = self.affine(w)  # (B, cin)
        weight = self.weight / math.sqrt(self.weight[0].numel())
        dcoefs = (weight[None] * styles[:, None, :, None, None]).square().sum(dim=(2, 3, 4)).add(1e-8).rsqrt()
        if self.up > 1:
            x = upfirdn2d(x, self.fir, up=self.up, padding=(2, 1, 2, 1), gain=self.up ** 2)
        x = x * styles[:, :, None, None]
        x = nn.functional.conv2d(x, weight, padding=1)
        noise = self.noise_const * self.noise_strength
        x = fma(x, dcoefs[:, :, None, None], noise)
        return bias_act(x, self.bias)


class _StyleGAN2ADA(nn.Module):
    def __init__(self, latent_dim, w_dim, mapping_depth, channels, stages, extra_layers):
        super().__init__()
        self.latent_dim = latent_dim
        self.mapping = nn.Sequential(*[_FullyConnected(latent_dim if i == 0 else w_dim, w_dim)
                                       for i in range(mapping_depth)])
        self.const = nn.Parameter(torch.randn(channels, 4, 4))
        layers, resolution = [_SynthesisLayer(channels, channels, w_dim, 4)], 4
        for _ in range(stages):
            resolution *= 2
            layers.append(_SynthesisLayer(channels, channels, w_dim, resolution, up=2))
        layers += [_SynthesisLayer(channels, channels, w_dim, resolution) for _ in range(extra_layers)]
        self.layers = nn.ModuleList(layers)
        self.to_rgb = nn.Linear(w_dim, channels)
        self.rgb_weight = nn.Parameter(torch.randn(3, channels, 1, 1) / math.sqrt(channels))
        self.rgb_bias = nn.Parameter(torch.zeros(3))

    def forward(self, z):
        z = z * (z.square().mean(dim=1, keepdim=True) + 1e-8).rsqrt()  # normalize_2nd_moment
        w = self.mapping(z)
        x = self.const[None].expand(z.shape[0], -1, -1, -1)
        for layer in self.layers:
            x = layer(x, w)
        x = x * self.to_rgb(w)[:, :, None, None]  # ToRGB: modulated 1x1, no demodulation
        return bias_act(nn.functional.conv2d(x, self.rgb_weight), self.rgb_bias, alpha=1.0, gain=1.0)


def stylegan2_ada(latent_dim=16, w_dim=16, *, mapping_depth=2, channels=8, image_size=16, extra_layers=0,
                  seed=0, dtype=torch.float32, device="cpu"):
    r"""A StyleGAN2-ADA-like generator whose ops are custom Functions without ``jvp``.

    .. math::

        w = M(z / \lVert z \rVert_{\mathrm{rms}}), \qquad
        x_{l+1} = \mathrm{bias\_act}\Big(\mathrm{fma}\big(\mathrm{conv}(x_l \odot s_l(w), W_l),\
                  d_l(w),\ n_l\big),\ b_l\Big)

    Built the way NVlabs' StyleGAN2-ADA is (its non-fused modulated-convolution path, which it
    takes in train mode and for fp16 with batch > 1): fully connected layers with ``bias_act``,
    modulated 3x3 convolutions with demodulation coefficients applied by ``fma`` together with
    constant noise, ``upfirdn2d`` FIR upsampling, and a modulated 1x1 ToRGB. ``bias_act``,
    ``fma`` and ``upfirdn2d`` are :mod:`mixedad.zoo._custom_ops`: ``autograd.Function``\ s with a
    differentiable backward and no ``jvp``, so PyTorch's forward mode cannot pass them and
    mixedad takes each on its local rule.

    Args:
        latent_dim, w_dim: sizes of z and w.
        mapping_depth: fully connected layers in the mapping network.
        channels: feature channels of every synthesis layer.
        image_size: output resolution, a power of two >= 4 (one upsampling layer per doubling).
        extra_layers: synthesis layers added at the final resolution (depth, for benchmarks).
        seed, dtype, device: construction options.

    Returns:
        A module in eval mode mapping (B, latent_dim) to (B, 3, image_size, image_size).

    Example:
        >>> import torch
        >>> from mixedad import zoo
        >>> zoo.stylegan2_ada(latent_dim=8, w_dim=8, image_size=8)(torch.randn(2, 8)).shape
        torch.Size([2, 3, 8, 8])
    """
    if image_size < 4 or image_size & (image_size - 1):
        raise ValueError(f"zoo.stylegan2_ada: expected image_size a power of two >= 4, got {image_size}.")
    if extra_layers < 0:
        raise ValueError(f"zoo.stylegan2_ada: expected extra_layers >= 0, got {extra_layers}.")
    stages = image_size.bit_length() - 3
    build = lambda: _StyleGAN2ADA(latent_dim, w_dim, mapping_depth, channels, stages, extra_layers)  # noqa: E731
    return finish(seeded(build, seed, (8, latent_dim)), dtype, device)
