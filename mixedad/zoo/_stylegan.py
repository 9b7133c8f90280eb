"""Zoo member: a StyleGAN2-like generator with modulated convolutions in plain torch ops."""
import math

import torch
import torch.nn.functional as F
from torch import nn

from mixedad.zoo._build import finish, seeded


class _ModulatedConv2d(nn.Module):
    """StyleGAN2's modulated convolution: per-sample weights scaled by a style, demodulated."""
    def __init__(self, cin, cout, kernel, w_dim, demodulate=True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cout, cin, kernel, kernel) / math.sqrt(cin * kernel * kernel))
        self.affine = nn.Linear(w_dim, cin)
        nn.init.ones_(self.affine.bias)
        self.bias = nn.Parameter(torch.zeros(cout))
        self.demodulate, self.padding = demodulate, kernel // 2

    def forward(self, x, w):
        batch, cin, height, width = x.shape
        style = self.affine(w)  # (B, cin)
        weight = self.weight[None] * style[:, None, :, None, None]  # (B, cout, cin, k, k)
        if self.demodulate:
            weight = weight * torch.rsqrt(weight.pow(2).sum(dim=(2, 3, 4), keepdim=True) + 1e-8)
        out = F.conv2d(x.reshape(1, batch * cin, height, width),
                       weight.reshape(-1, cin, *weight.shape[3:]), padding=self.padding, groups=batch)
        return out.reshape(batch, -1, height, width) + self.bias[None, :, None, None]


class _StyleGenerator(nn.Module):
    def __init__(self, latent_dim, w_dim, mapping_depth, channels, stages):
        super().__init__()
        self.latent_dim = latent_dim
        layers = []
        for i in range(mapping_depth):
            layers += [nn.Linear(latent_dim if i == 0 else w_dim, w_dim), nn.LeakyReLU(0.2)]
        self.mapping = nn.Sequential(*layers)
        self.const = nn.Parameter(torch.randn(1, channels, 4, 4))
        self.convs = nn.ModuleList(_ModulatedConv2d(channels, channels, 3, w_dim) for _ in range(stages + 1))
        self.to_rgb = _ModulatedConv2d(channels, 3, 1, w_dim, demodulate=False)
        self.act = nn.LeakyReLU(0.2)

    def forward(self, z):
        z = z * torch.rsqrt(z.pow(2).mean(dim=-1, keepdim=True) + 1e-8)  # pixel norm
        w = self.mapping(z)
        x = self.const.expand(z.shape[0], -1, -1, -1)
        for i, conv in enumerate(self.convs):
            if i > 0:
                x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
            x = self.act(conv(x, w))
        return self.to_rgb(x, w)


def stylegan(latent_dim=16, w_dim=16, *, mapping_depth=4, channels=8, image_size=16,
             seed=0, dtype=torch.float32, device="cpu"):
    r"""A StyleGAN2-like generator: a mapping MLP to w, then modulated convolutions.

    .. math::

        w = M(z / \lVert z \rVert_{\mathrm{rms}}), \qquad
        W'_{oik} = \frac{W_{oik}\, s_i(w)}{\sqrt{\sum_{i,k} (W_{oik}\, s_i(w))^2 + \epsilon}}

    Example:
        >>> import torch
        >>> from mixedad import zoo
        >>> zoo.stylegan(latent_dim=8, w_dim=8, image_size=8)(torch.randn(2, 8)).shape
        torch.Size([2, 3, 8, 8])

    z (B, latent_dim) is pixel-normalised and mapped through ``mapping_depth`` Linear-LeakyReLU
    layers to a style vector w. A learned 4x4 constant goes through a modulated, demodulated 3x3
    convolution per resolution (bilinear upsampling between them), and a modulated 1x1 ToRGB
    gives (B, 3, image_size, image_size). The convolution weights depend on z, so the tangent
    flows through the weights as well as the activations.
    """
    if image_size < 4 or image_size & (image_size - 1):
        raise ValueError(f"zoo.stylegan: expected image_size a power of two >= 4, got {image_size}.")
    stages = image_size.bit_length() - 3
    build = lambda: _StyleGenerator(latent_dim, w_dim, mapping_depth, channels, stages)  # noqa: E731
    return finish(seeded(build, seed, (8, latent_dim)), dtype, device)
