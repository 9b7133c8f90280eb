"""Zoo member: a VQ-style decoder (VQGAN, diffusers' VQModel) with nearest-code quantisation."""
import torch
import torch.nn.functional as F
from torch import nn

from mixedad.zoo._build import finish, seeded


class _ResBlock(nn.Module):
    def __init__(self, channels, groups):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv(F.silu(self.norm(x)))


class _VQDecoder(nn.Module):
    def __init__(self, latent_dim, code_dim, codebook_size, grid, channels, blocks, groups, stages):
        super().__init__()
        self.latent_dim, self.code_dim, self.grid = latent_dim, code_dim, grid
        self.encode = nn.Linear(latent_dim, code_dim * grid * grid)
        self.codebook = nn.Parameter(torch.randn(codebook_size, code_dim))
        self.conv_in = nn.Conv2d(code_dim, channels, 3, padding=1)
        self.blocks = nn.ModuleList(_ResBlock(channels, groups) for _ in range(blocks))
        self.ups = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in range(stages))
        self.norm_out = nn.GroupNorm(groups, channels)
        self.conv_out = nn.Conv2d(channels, 3, 3, padding=1)

    def quantize(self, z_e):
        """Nearest codebook entry per position, with the straight-through estimator."""
        b, c, h, w = z_e.shape
        flat = z_e.permute(0, 2, 3, 1).reshape(-1, c)
        index = torch.cdist(flat, self.codebook).argmin(dim=1)
        z_q = self.codebook[index].reshape(b, h, w, c).permute(0, 3, 1, 2)
        return z_e + (z_q - z_e).detach()

    def forward(self, z):
        z_e = self.encode(z).reshape(-1, self.code_dim, self.grid, self.grid)
        x = self.conv_in(self.quantize(z_e))
        for block in self.blocks:
            x = block(x)
        for up in self.ups:
            x = up(F.interpolate(x, scale_factor=2, mode="nearest"))
        return self.conv_out(F.silu(self.norm_out(x)))


def vq_decoder(latent_dim=16, *, code_dim=4, codebook_size=32, grid=4, channels=8, blocks=2, groups=4,
               image_size=8, seed=0, dtype=torch.float32, device="cpu"):
    r"""A VQ-style decoder: z to a code grid, nearest-code quantisation, a convolutional decoder.

    .. math::

        k_{hw} = \arg\min_k \lVert e_{hw}(z) - c_k \rVert_2, \qquad
        q = e + \mathrm{sg}(c_k - e), \qquad G(z) = D(q)

    z (B, latent_dim) is mapped by a Linear layer to a ``code_dim`` x ``grid`` x ``grid`` map e;
    each position is replaced by its nearest codebook entry (``torch.cdist`` and ``argmin``),
    with the straight-through estimator (``sg`` is ``detach``) as VQGAN and diffusers' VQModel
    use it; then residual blocks (GroupNorm, SiLU, 3x3 convolution) and nearest-neighbour
    upsampling to (B, 3, image_size, image_size). ``torch.cdist`` has no forward-AD formula;
    its tangent only feeds ``argmin``.

    Args:
        latent_dim: size of z.
        code_dim, codebook_size, grid: the code map and the codebook.
        channels, blocks, groups: width, number of residual blocks (depth) and GroupNorm groups.
        image_size: output resolution, ``grid`` times a power of two.
        seed, dtype, device: construction options.

    Example:
        >>> import torch
        >>> from mixedad import zoo
        >>> zoo.vq_decoder(latent_dim=8)(torch.randn(2, 8)).shape
        torch.Size([2, 3, 8, 8])
    """
    stages = (image_size // grid).bit_length() - 1
    if image_size % grid or grid << stages != image_size:
        raise ValueError(f"zoo.vq_decoder: expected image_size to be grid={grid} times a power of two, "
                         f"got {image_size}.")
    if channels % groups:
        raise ValueError(f"zoo.vq_decoder: expected channels divisible by groups={groups}, got {channels}.")
    build = lambda: _VQDecoder(latent_dim, code_dim, codebook_size, grid, channels, blocks, groups, stages)  # noqa: E731
    return finish(seeded(build, seed, (8, latent_dim)), dtype, device)
