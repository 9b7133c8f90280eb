"""Ops and generators that PyTorch's forward mode cannot take, shared by tests."""
import torch
import torch.nn.functional as F
from torch import nn

from mixedad import zoo


class SinWithoutJvp(torch.autograd.Function):
    """A custom op with backward (differentiable, for double backward) but no jvp."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos()


class GroupNormChannelsLast(nn.Module):
    """Conv + GroupNorm + SiLU blocks on channels_last maps, as diffusers' UNet2DModel runs them."""

    def __init__(self, depth, channels=16):
        super().__init__()
        self.latent_dim, self.channels = 8, channels
        self.embed = nn.Linear(8, channels * 8 * 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1),
                                                  nn.GroupNorm(4, channels), nn.SiLU()) for _ in range(depth))

    def forward(self, z):
        x = self.embed(z).reshape(-1, self.channels, 8, 8).contiguous(memory_format=torch.channels_last)
        for block in self.blocks:
            x = x + block(x)
        return x


class GridSampleWarp(nn.Module):
    """Each block warps the map by a flow it computes from it, with F.grid_sample."""

    def __init__(self, depth, channels=8, size=8):
        super().__init__()
        self.latent_dim, self.channels, self.size = 8, channels, size
        self.embed = nn.Linear(8, channels * size * size)
        self.flows = nn.ModuleList(nn.Conv2d(channels, 2, 3, padding=1) for _ in range(depth))
        self.mix = nn.ModuleList(nn.Conv2d(channels, channels, 1) for _ in range(depth))
        ramp = torch.linspace(-1, 1, size)
        self.register_buffer("identity", torch.stack(torch.meshgrid(ramp, ramp, indexing="xy"), dim=-1)[None])

    def forward(self, z):
        x = self.embed(z).reshape(-1, self.channels, self.size, self.size)
        for flow, mix in zip(self.flows, self.mix):
            grid = self.identity + 0.1 * torch.tanh(flow(x)).permute(0, 2, 3, 1)
            x = torch.tanh(mix(F.grid_sample(x, grid, align_corners=True)))
        return x


class StackedLSTM(nn.Module):
    """One nn.LSTM per layer (on the CPU in float32 PyTorch runs mkldnn_rnn_layer, with no formula)."""

    def __init__(self, depth, hidden=16, steps=8):
        super().__init__()
        self.latent_dim, self.steps, self.hidden = 8, steps, hidden
        self.embed = nn.Linear(8, steps * hidden)
        self.layers = nn.ModuleList(nn.LSTM(hidden, hidden, batch_first=True) for _ in range(depth))

    def forward(self, z):
        x = self.embed(z).reshape(-1, self.steps, self.hidden)
        for layer in self.layers:
            x = x + layer(x)[0]
        return x


def build(name, depth, dtype):
    """``(G, z, y, v)`` for the generator ``name`` with ``depth`` layers or blocks, random inputs."""
    if name == "stylegan2_ada":
        G = zoo.stylegan2_ada(latent_dim=8, w_dim=8, channels=16, image_size=8, extra_layers=depth, dtype=dtype)
    elif name == "vq_decoder":
        G = zoo.vq_decoder(latent_dim=8, channels=16, blocks=depth, image_size=8, dtype=dtype)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            G = {"group_norm_channels_last": GroupNormChannelsLast, "grid_sample_warp": GridSampleWarp,
                 "lstm": StackedLSTM}[name](depth).to(dtype).eval()
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(2, 8, generator=gen, dtype=dtype)
    v = torch.randn(2, 8, generator=gen, dtype=dtype)
    with torch.no_grad():
        y = torch.randn(G(z).shape, generator=gen, dtype=dtype)
    return G, z, y, v


NAMES = ["stylegan2_ada", "vq_decoder", "group_norm_channels_last", "grid_sample_warp", "lstm"]


def cubic(y, g):
    return ((y + g) ** 3).sum()
