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
import torch
from torch import nn

__all__ = ["mlp", "dcgan", "latent_shape"]


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
    """Rescale each weighted layer so a random tangent leaves it with unit standard deviation."""
    x = torch.randn(input_shape)
    t = torch.randn(input_shape)
    for layer in module:
        if isinstance(layer, _WEIGHTED):
            _, t_out = torch.func.jvp(layer, (x,), (t,))
            # Bias does not enter the tangent, so one rescale is exact.
            layer.weight.div_(t_out.std())
        x, t = torch.func.jvp(layer, (x,), (t,))


def _finish(module, dtype, device):
    return module.to(dtype=dtype, device=device)


def mlp(depth=8, width=64, *, in_features=None, out_features=None, activation="tanh",
        seed=0, dtype=torch.float32, device="cpu"):
    """A frozen MLP: ``depth`` Linear layers, each but the last followed by the activation.

    Args:
        depth: number of Linear layers (>= 1).
        width: hidden width; also the default for in_features and out_features.
        in_features, out_features: input and output sizes (keyword-only).
        activation: "tanh", "relu", "leaky_relu" or "softplus".
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
    """A DCGAN-style generator: ConvTranspose2d, BatchNorm2d, ReLU, and tanh at the end.

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


def latent_shape(G, batch):
    """The shape of a batch of inputs for a zoo member: (batch, in_features or latent_dim)."""
    first = next(m for m in G.modules() if isinstance(m, (nn.Linear, _Reshape)))
    return (batch, first.in_features if isinstance(first, nn.Linear) else first.shape[0])
