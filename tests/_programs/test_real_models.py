"""compile=True on real model code (optional: skipped where diffusers or transformers is not installed)."""
import pytest
import torch
from torch import nn

import mixedad
from mixedad.reference import differentiable_attention, double_backward_mixed_grad

D = torch.float64


def f(y, g):
    return ((y + g) ** 3).sum()


def _check(G, z):
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        y = torch.randn(G(z).shape, dtype=D, generator=gen)
    v = torch.randn(z.shape, dtype=D, generator=gen)
    out = mixedad.mixed_grad(f, G, z, y, v, compile=True)
    [entry] = mixedad.programs.compiled_tangents(G)
    assert entry.status == "compiled", entry.reason
    out = mixedad.mixed_grad(f, G, z, y, v, compile=True)
    with differentiable_attention():
        reference = double_backward_mixed_grad(f, G, z, y, v)
    assert (out - reference).abs().max() <= 1e-9 * reference.abs().max()


def test_diffusers_vae_decoder():
    diffusers = pytest.importorskip("diffusers")
    vae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                                  layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=16)

    class Decode(nn.Module):
        def __init__(self):
            super().__init__()
            self.vae = vae

        def forward(self, z):
            return self.vae.decode(z).sample

    _check(Decode().to(D).eval(), torch.randn(1, 4, 4, 4, dtype=D))


def test_transformers_gpt2_block():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=16, vocab_size=8,
                                     attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    block = transformers.GPT2Model(config).h[0]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, e):
            out = self.block(e)  # the hidden states, alone or first in a tuple (transformers' versions differ)
            return out[0] if isinstance(out, tuple) else out

    _check(Block().to(D).eval(), torch.randn(2, 5, 16, dtype=D))
