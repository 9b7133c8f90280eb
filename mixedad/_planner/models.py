r"""Generators at real sizes, built on the meta device for ``python -m mixedad plan``.

Each builder takes ``(batch, resolution, dtype)`` and returns ``(G, z, y, what)``: G built under
``torch.device("meta")`` with random-weight configurations (nothing allocated, nothing
downloaded), z and y meta tensors, and a one-line description. The resolution is an image side
for image generators and a sequence length for GPT-2.

.. math::

    \mathrm{params} \to \text{meta}: \quad \text{bytes known, none allocated}
"""
import importlib.util

import torch

from mixedad import zoo

__all__ = ["PLAN_MODELS", "build"]


def _image(G, batch, latent, resolution, dtype, channels=3):
    z = torch.empty(batch, latent, device="meta", dtype=dtype)
    y = torch.empty(batch, channels, resolution, resolution, device="meta", dtype=dtype)
    return z, y


def _stylegan2(batch, resolution, dtype):
    with torch.device("meta"):
        G = zoo.stylegan2_ada(latent_dim=512, w_dim=512, mapping_depth=8, channels=32, image_size=resolution,
                              extra_layers=2, dtype=dtype)
    return (G, *_image(G, batch, 512, resolution, dtype),
            f"StyleGAN2-like (zoo.stylegan2_ada: custom Functions, 32 channels as config-f at 1024^2) at {resolution}^2")


def _dcgan(batch, resolution, dtype):
    with torch.device("meta"):
        G = zoo.dcgan(latent_dim=128, channels=128, image_size=resolution, extra_blocks=2, dtype=dtype)
    return (G, *_image(G, batch, 128, resolution, dtype), f"DCGAN (zoo.dcgan, 128 channels) at {resolution}^2")


def _vq(batch, resolution, dtype):
    with torch.device("meta"):
        G = zoo.vq_decoder(latent_dim=256, code_dim=64, codebook_size=1024, grid=16, channels=128, blocks=4,
                           groups=32, image_size=resolution, dtype=dtype)
    return (G, *_image(G, batch, 256, resolution, dtype),
            f"VQ decoder (zoo.vq_decoder: cdist quantiser, GroupNorm, 128 channels) at {resolution}^2")


def _mlp(batch, resolution, dtype):
    with torch.device("meta"):
        G = zoo.mlp(64, resolution, dtype=dtype)
    z = torch.empty(batch, resolution, device="meta", dtype=dtype)
    return G, z, torch.empty_like(z), f"MLP (zoo.mlp), 64 layers of width {resolution}"


def _gpt2_medium(batch, resolution, dtype):
    if importlib.util.find_spec("transformers") is None:
        raise ModuleNotFoundError("the gpt2-medium model needs transformers (pip install transformers)")
    import transformers

    config = transformers.GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=resolution,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.GPT2Model(config).to(dtype).eval()
    z = torch.empty(batch, resolution, 1024, device="meta", dtype=dtype)
    return gpt2_call(model), z, torch.empty_like(z), f"GPT-2-medium (24 layers, 1024 wide, SDPA), {resolution} tokens"


class gpt2_call(torch.nn.Module):
    """GPT-2 as G: input embeddings to the last hidden state, causal, as ``GPT2Model`` runs without a mask.

    Given no attention mask, transformers checks the position ids for packed sequences (reading values, which meta
    tensors do not have), finds none, and leaves the causal mask to SDPA (``is_causal=True``, no mask tensor, so a
    fused kernel runs). This runs the same modules with that decision made: positions, dropout, each block with no
    mask, the final norm; no KV cache kept (a generator, not a decoder).
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, embeddings):
        m = self.model
        positions = torch.arange(embeddings.shape[1], device=embeddings.device)[None]
        hidden = m.drop(embeddings + m.wpe(positions))
        for block in m.h:
            out = block(hidden, None, None, use_cache=False)  # no mask: SDPA applies the causal one itself
            hidden = out[0] if isinstance(out, tuple) else out  # transformers' versions differ
        return m.ln_f(hidden)


def _sd_vae(batch, resolution, dtype):
    if importlib.util.find_spec("diffusers") is None:
        raise ModuleNotFoundError("the sd-vae model needs diffusers (pip install diffusers)")
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                            block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                            sample_size=resolution).to(dtype).eval()
    side = resolution // 8
    z = torch.empty(batch, 4, side, side, device="meta", dtype=dtype)
    return (vae_decoder(vae), z, torch.empty(batch, 3, resolution, resolution, device="meta", dtype=dtype),
            f"Stable Diffusion VAE decoder at {resolution}^2")


class vae_decoder(torch.nn.Module):
    """A diffusers AutoencoderKL's decoder as G: latents to images."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latents):
        return self.vae.decode(latents).sample


#: model name -> builder(batch, resolution, dtype) -> (G, z, y, description)
PLAN_MODELS = {"stylegan2": _stylegan2, "dcgan": _dcgan, "vq_decoder": _vq, "mlp": _mlp, "gpt2-medium": _gpt2_medium,
               "sd-vae": _sd_vae}


def build(name, batch, resolution, dtype):
    """``(G, z, y, description)`` for ``name`` (see :data:`PLAN_MODELS`)."""
    return PLAN_MODELS[name](batch, resolution, dtype)
