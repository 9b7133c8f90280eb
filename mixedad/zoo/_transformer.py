"""Zoo member: a small causal transformer decoder."""
import torch
import torch.nn.functional as F
from torch import nn

from mixedad.zoo._build import finish, seeded


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
    return finish(seeded(build, seed, (8, latent_dim)), dtype, device)


class _AttentionStack(nn.Module):
    def __init__(self, d_model, nhead, layers, causal):
        super().__init__()
        self.d_model, self.nhead, self.causal = d_model, nhead, causal
        self.qkv = nn.ModuleList(nn.Linear(d_model, 3 * d_model) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(layers))

    def forward(self, x):
        batch, tokens, d = x.shape
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = qkv(x).reshape(batch, tokens, 3, self.nhead, d // self.nhead).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
            x = x + out(a.transpose(1, 2).reshape(batch, tokens, d))
        return x


def attention_stack(d_model=64, *, nhead=4, layers=2, causal=True, seed=0, dtype=torch.float32, device="cpu"):
    r"""Bare attention layers on a sequence: the generator of mixedad's attention benchmark.

    .. math::

        x_{l+1} = x_l + W^o_l\, \mathrm{SDPA}\big(W^q_l x_l, W^k_l x_l, W^v_l x_l\big)

    z is the sequence itself, (B, T, d_model), of any length T; each layer is a Linear to
    queries, keys and values, ``F.scaled_dot_product_attention`` over ``nhead`` heads (causal by
    default) and a Linear out, with a residual connection.

    Example:
        >>> import torch
        >>> from mixedad import zoo
        >>> zoo.attention_stack(16, nhead=2)(torch.randn(1, 10, 16)).shape
        torch.Size([1, 10, 16])
    """
    if d_model % nhead:
        raise ValueError(f"zoo.attention_stack: expected d_model divisible by nhead={nhead}, got {d_model}.")
    build = lambda: _AttentionStack(d_model, nhead, layers, causal)  # noqa: E731
    return finish(seeded(build, seed, (2, 16, d_model)), dtype, device)
