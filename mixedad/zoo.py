"""Random-weight generators for tests, the demo, benchmarks and notebooks.

Nothing is downloaded: every member is built from a seed with random weights (and, for
BatchNorm, random running statistics so eval mode is not the identity). Construction forks the
global RNG, so building a generator leaves the caller's random state as it was. Members are
returned in eval mode with parameters that require grad, as a freshly loaded pretrained model
would be; mixedad treats them as frozen either way.

Random deep networks at PyTorch's default initialisation have vanishing Jacobians: through 64
tanh layers J_G v shrinks to about 1e-16, and every derivative a test compares would be
numerically zero. So each member is calibrated once after construction, like a trained
generator's well-conditioned Jacobian: walking the layers in order with a random input and
tangent, each Linear or convolution weight is rescaled so that the tangent leaves it with unit
standard deviation (a data-independent form of LSUV initialisation, applied to J_G v).
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad

from mixedad.tangents import differentiable_attention

__all__ = ["mlp", "dcgan", "resnet", "stylegan", "transformer", "latent_shape", "MEMBERS"]


_WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
             nn.ConvTranspose3d)


def _seeded(build, seed, input_shape):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build()
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                m.running_mean.normal_(0.0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
        module.eval()
        _calibrate(module, input_shape)
    return module


@torch.no_grad()
def _calibrate(module, input_shape):
    """Rescale each weighted layer so a random tangent leaves it with unit standard deviation.

    One forward-mode pass in execution order: a forward hook on each Linear or convolution
    measures the tangent of its output, divides the weight by that standard deviation (the bias
    does not enter the tangent, so one rescale is exact) and recomputes the output, so later
    layers are calibrated on what they will really see.
    """
    done = set()

    def hook(layer, args, output):
        if layer in done:
            return None
        done.add(layer)
        tangent = forward_ad.unpack_dual(output).tangent
        scale = None if tangent is None else tangent.std()
        if scale is None or not torch.isfinite(scale) or scale <= 0:
            return None
        layer.weight.div_(scale)
        return layer(*args)

    handles = [m.register_forward_hook(hook) for m in module.modules() if isinstance(m, _WEIGHTED)]
    try:
        with differentiable_attention(), forward_ad.dual_level():
            module(forward_ad.make_dual(torch.randn(input_shape), torch.randn(input_shape)))
    finally:
        for handle in handles:
            handle.remove()


def _finish(module, dtype, device):
    return module.to(dtype=dtype, device=device)


def mlp(depth=8, width=64, *, in_features=None, out_features=None, activation="tanh",
        dropout=0.0, seed=0, dtype=torch.float32, device="cpu"):
    r"""A frozen MLP: ``depth`` Linear layers, each but the last followed by the activation.

    .. math::

        G(z) = W_D\, \sigma\big(\cdots \sigma(W_1 z + b_1) \cdots\big) + b_D

    Example:
        >>> import torch
        >>> from mixedad import zoo
        >>> zoo.mlp(3, 8, in_features=4, out_features=2)(torch.randn(5, 4)).shape
        torch.Size([5, 2])

    Args:
        depth: number of Linear layers (>= 1).
        width: hidden width; also the default for in_features and out_features.
        in_features, out_features: input and output sizes (keyword-only).
        activation: "tanh", "relu", "leaky_relu" or "softplus".
        dropout: probability of a Dropout after each activation (none when 0).
        seed, dtype, device: construction options.

    Returns:
        An ``nn.Sequential`` in eval mode mapping (..., in_features) to (..., out_features).
    """
    if depth < 1:
        raise ValueError(f"zoo.mlp: expected depth >= 1, got {depth}.")
    acts = {"tanh": nn.Tanh, "relu": nn.ReLU, "leaky_relu": nn.LeakyReLU, "softplus": nn.Softplus}
    if activation not in acts:
        raise ValueError(f"zoo.mlp: expected activation in {sorted(acts)}, got {activation!r}.")
    sizes = [in_features or width] + [width] * (depth - 1) + [out_features or width]

    def build():
        layers = []
        for i in range(depth):
            layers.append(nn.Linear(sizes[i], sizes[i + 1]))
            if i < depth - 1:
                layers.append(acts[activation]())
                if dropout:
                    layers.append(nn.Dropout(dropout))
        return nn.Sequential(*layers)

    return _finish(_seeded(build, seed, (64, sizes[0])), dtype, device)


class _Reshape(nn.Module):
    def __init__(self, *shape):
        super().__init__()
        self.shape = shape

    def forward(self, x):
        return x.reshape(*x.shape[:-1], *self.shape)


def dcgan(latent_dim=16, channels=8, *, image_size=32, extra_blocks=0, out_channels=3,
          seed=0, dtype=torch.float32, device="cpu"):
    r"""A DCGAN-style generator: ConvTranspose2d, BatchNorm2d, ReLU, and tanh at the end.

    .. math::

        G(z) = \tanh\big(T_K(\rho(\mathrm{BN}(T_{K-1}(\cdots \rho(\mathrm{BN}(T_1 z))\cdots))))\big)

    with :math:`T_k` transposed convolutions (and extra 3x3 convolution blocks) and :math:`\rho` ReLU.

    Example:
        >>> import torch
        >>> from mixedad import zoo
        >>> zoo.dcgan(latent_dim=16, image_size=16)(torch.randn(2, 16)).shape
        torch.Size([2, 3, 16, 16])

    z of shape (B, latent_dim) is mapped to images (B, out_channels, image_size, image_size).
    The first ConvTranspose2d makes a 4x4 map with ``channels * 2**k`` channels; each further
    stage doubles the resolution and halves the channels. ``extra_blocks`` 3x3
    Conv2d-BatchNorm-ReLU blocks follow each upsampling stage, to make the network deeper.

    Args:
        latent_dim: size of z's last dimension.
        channels: channel count at the last hidden stage (keyword options follow).
        image_size: output resolution, a power of two >= 8.
        extra_blocks: number of extra conv blocks per stage.
        out_channels: output channels.
        seed, dtype, device: construction options.

    Returns:
        An ``nn.Sequential`` in eval mode.
    """
    stages = image_size.bit_length() - 3  # 4 -> image_size takes log2(image_size / 4) stages
    if image_size < 8 or image_size & (image_size - 1):
        raise ValueError(f"zoo.dcgan: expected image_size a power of two >= 8, got {image_size}.")

    def block(cin, cout, extra):
        layers = [nn.ConvTranspose2d(cin, cout, 4, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
        for _ in range(extra):
            layers += [nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
        return layers

    def build():
        c = channels * 2 ** (stages - 1)
        layers = [_Reshape(latent_dim, 1, 1), nn.ConvTranspose2d(latent_dim, c, 4, 1, 0, bias=False),
                  nn.BatchNorm2d(c), nn.ReLU()]
        for _ in range(stages - 1):
            layers += block(c, c // 2, extra_blocks)
            c //= 2
        layers += [nn.ConvTranspose2d(c, out_channels, 4, 2, 1), nn.Tanh()]
        return nn.Sequential(*layers)

    return _finish(_seeded(build, seed, (8, latent_dim)), dtype, device)


def _norm2d(kind, channels):
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "instance":
        return nn.InstanceNorm2d(channels, affine=True)
    raise ValueError(f"zoo.resnet: expected norm 'batch' or 'instance', got {kind!r}.")


class _UpBlock(nn.Module):
    """Upsample, two 3x3 convolutions with normalisation and LeakyReLU, and a 1x1 skip."""

    def __init__(self, cin, cout, norm):
        super().__init__()
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.conv1, self.norm1 = nn.Conv2d(cin, cout, 3, 1, 1), _norm2d(norm, cout)
        self.conv2, self.norm2 = nn.Conv2d(cout, cout, 3, 1, 1), _norm2d(norm, cout)
        self.skip = nn.Conv2d(cin, cout, 1)
        self.act = nn.LeakyReLU(0.2)

    def forward(self, x):
        x = self.up(x)
        h = self.act(self.norm1(self.conv1(x)))
        return self.act(self.norm2(self.conv2(h)) + self.skip(x))


class _ResNetGenerator(nn.Module):
    def __init__(self, latent_dim, channels, stages, blocks, norm, out_channels):
        super().__init__()
        self.latent_dim, self.channels = latent_dim, channels
        self.fc = nn.Linear(latent_dim, channels * 16)
        layers, c = [], channels
        for _ in range(stages):
            layers.append(_UpBlock(c, max(c // 2, 4), norm))
            c = max(c // 2, 4)
            for _ in range(blocks - 1):
                layers.append(_UpBlock(c, c, norm))
                layers[-1].up = nn.Identity()
        self.blocks = nn.Sequential(*layers)
        self.out = nn.Conv2d(c, out_channels, 3, 1, 1)

    def forward(self, z):
        x = self.fc(z).reshape(*z.shape[:-1], self.channels, 4, 4)
        return torch.tanh(self.out(self.blocks(x)))


def resnet(latent_dim=16, channels=16, *, image_size=16, blocks_per_stage=1, norm="batch",
           out_channels=3, seed=0, dtype=torch.float32, device="cpu"):
    r"""A ResNet-style upsampling generator: Linear to 4x4, then residual upsampling blocks.

    .. math::

        h_{k+1} = \phi\big(N_2(C_2\, \phi(N_1(C_1 U h_k))) + S\, U h_k\big), \qquad
        G(z) = \tanh(C_{\mathrm{out}}\, h_K), \quad h_0 = \mathrm{reshape}(W z + b)

    with U nearest upsampling, C convolutions, N normalisations, S a 1x1 skip and φ LeakyReLU.

    Example:
        >>> import torch
        >>> from mixedad import zoo
        >>> zoo.resnet(latent_dim=8, norm="instance")(torch.randn(2, 8)).shape
        torch.Size([2, 3, 16, 16])

    Each block is nearest Upsample, Conv2d-Norm-LeakyReLU twice and a 1x1 Conv2d skip
    connection; ``norm`` is "batch" (BatchNorm2d) or "instance" (InstanceNorm2d, affine).
    z (B, latent_dim) maps to images (B, out_channels, image_size, image_size).
    """
    if image_size < 8 or image_size & (image_size - 1):
        raise ValueError(f"zoo.resnet: expected image_size a power of two >= 8, got {image_size}.")
    _norm2d(norm, 1)
    stages = image_size.bit_length() - 3
    build = lambda: _ResNetGenerator(latent_dim, channels, stages, blocks_per_stage, norm, out_channels)  # noqa: E731
    return _finish(_seeded(build, seed, (8, latent_dim)), dtype, device)


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
    return _finish(_seeded(build, seed, (8, latent_dim)), dtype, device)


class _SdpaBlock(nn.Module):
    """A pre-norm causal self-attention block on F.scaled_dot_product_attention."""

    def __init__(self, d_model, nhead, dropout):
        super().__init__()
        self.nhead, self.dropout = nhead, dropout
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))

    def forward(self, x):
        batch, tokens, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(batch, tokens, 3, self.nhead, d // self.nhead).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(a.transpose(1, 2).reshape(batch, tokens, d))
        return x + self.ff(self.norm2(x))


class _TransformerDecoder(nn.Module):
    def __init__(self, latent_dim, d_model, nhead, layers, tokens, out_features, dropout, attention):
        super().__init__()
        self.latent_dim, self.tokens, self.d_model = latent_dim, tokens, d_model
        self.embed = nn.Linear(latent_dim, tokens * d_model)
        self.position = nn.Parameter(torch.randn(tokens, d_model) * 0.1)
        if attention == "layer":
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(d_model, nhead, 2 * d_model, dropout, batch_first=True)
                for _ in range(layers))
        else:
            self.blocks = nn.ModuleList(_SdpaBlock(d_model, nhead, dropout) for _ in range(layers))
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(tokens))
        self.attention = attention
        self.head = nn.Linear(d_model, out_features)

    def forward(self, z):
        x = self.embed(z).reshape(*z.shape[:-1], self.tokens, self.d_model) + self.position
        for block in self.blocks:
            x = block(x, src_mask=self.mask.to(x.dtype), is_causal=True) if self.attention == "layer" else block(x)
        return self.head(x)


def transformer(latent_dim=16, d_model=16, *, nhead=2, layers=2, tokens=8, out_features=8,
                dropout=0.0, attention="layer", seed=0, dtype=torch.float32, device="cpu"):
    r"""A small causal transformer decoder: z is embedded as ``tokens`` tokens, then decoded.

    .. math::

        h_0 = \mathrm{reshape}(W_e z) + P, \qquad h_{l+1} = \mathrm{Block}_l(h_l), \qquad G(z) = W_o h_L

    with causal self-attention in every block.

    Example:
        >>> import torch
        >>> from mixedad import zoo
        >>> zoo.transformer(latent_dim=8, d_model=8, tokens=4)(torch.randn(2, 8)).shape
        torch.Size([2, 4, 8])

    ``attention="layer"`` stacks nn.TransformerEncoderLayer (post-norm) with a causal mask;
    ``attention="sdpa"`` stacks pre-norm blocks calling F.scaled_dot_product_attention with
    ``is_causal=True``. Both PyTorch fast paths (the fused encoder-layer kernel and the flash /
    memory-efficient SDPA kernels) lack forward-AD formulas; mixedad switches them off while it
    pushes tangents. z (B, latent_dim) maps to (B, tokens, out_features).
    """
    if attention not in ("layer", "sdpa"):
        raise ValueError(f"zoo.transformer: expected attention 'layer' or 'sdpa', got {attention!r}.")
    build = lambda: _TransformerDecoder(latent_dim, d_model, nhead, layers, tokens, out_features, dropout, attention)  # noqa: E731
    return _finish(_seeded(build, seed, (8, latent_dim)), dtype, device)


#: Every member with small default sizes, by name: ``MEMBERS[name](dtype=..., seed=...)``.
MEMBERS = {
    "mlp": lambda **kw: mlp(4, 16, **kw),
    "dcgan": lambda **kw: dcgan(latent_dim=8, channels=4, image_size=8, extra_blocks=1, **kw),
    "resnet_batchnorm": lambda **kw: resnet(latent_dim=8, channels=8, image_size=8, **kw),
    "resnet_instancenorm": lambda **kw: resnet(latent_dim=8, channels=8, image_size=8, norm="instance", **kw),
    "stylegan": lambda **kw: stylegan(latent_dim=8, w_dim=8, channels=4, image_size=8, **kw),
    "transformer_layer": lambda **kw: transformer(latent_dim=8, d_model=8, tokens=4, **kw),
    "transformer_sdpa": lambda **kw: transformer(latent_dim=8, d_model=8, tokens=4, attention="sdpa", **kw),
}


def latent_shape(G, batch):
    r"""The shape of a batch of inputs for a zoo member: (batch, in_features or latent_dim).

    .. math::

        \mathrm{latent\_shape}(G, B) = (B, d_z)

    Example:
        >>> from mixedad import zoo
        >>> zoo.latent_shape(zoo.dcgan(latent_dim=12), 5)
        (5, 12)
    """
    latent = getattr(G, "latent_dim", None)
    if latent is not None:
        return (batch, latent)
    first = next(m for m in G.modules() if isinstance(m, (nn.Linear, _Reshape)))
    return (batch, first.in_features if isinstance(first, nn.Linear) else first.shape[0])
