"""Zoo members: MLP, DCGAN-style and ResNet-style generators."""
import torch
from torch import nn

from mixedad.zoo._build import finish, seeded


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

    return finish(seeded(build, seed, (64, sizes[0])), dtype, device)


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
        layers = [nn.Unflatten(-1, (latent_dim, 1, 1)), nn.ConvTranspose2d(latent_dim, c, 4, 1, 0, bias=False),
                  nn.BatchNorm2d(c), nn.ReLU()]
        for _ in range(stages - 1):
            layers += block(c, c // 2, extra_blocks)
            c //= 2
        layers += [nn.ConvTranspose2d(c, out_channels, 4, 2, 1), nn.Tanh()]
        return nn.Sequential(*layers)

    return finish(seeded(build, seed, (8, latent_dim)), dtype, device)


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
    return finish(seeded(build, seed, (8, latent_dim)), dtype, device)
