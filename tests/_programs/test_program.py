"""Tangent programs against double backward, in float64: composite models that exercise every rule family."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixedad
from mixedad._programs.program import write
from mixedad._programs.rules import Unsupported
from tests._programs.common import assert_program_matches, program_jvp, reverse_mode_jvp


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")
        self.norm = nn.GroupNorm(2, 4)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")

    def forward(self, x):
        h = self.conv(F.silu(self.norm(x)))
        a, b = h.chunk(2, dim=1)
        h = torch.cat([a * b, a / (b.exp() + 1), b], dim=1)
        return self.up(x + h[:, :4]).flatten(2).transpose(1, 2)


class Modulated(nn.Module):
    """A StyleGAN-like modulated convolution: the weight carries a tangent (the product rule through F.conv2d)."""

    def __init__(self):
        super().__init__()
        self.affine = nn.Linear(3, 4)
        self.weight = nn.Parameter(torch.randn(5, 4, 3, 3))

    def forward(self, z):
        style = self.affine(z)
        b = z.shape[0]
        w = self.weight[None] * style[:, None, :, None, None]
        w = w * torch.rsqrt(w.pow(2).sum(dim=(2, 3, 4), keepdim=True) + 1e-8)
        x = torch.ones(1, b * 4, 6, 6, dtype=z.dtype) * style.reshape(1, -1, 1, 1).abs().add(1).sqrt()
        out = F.conv2d(x, w.reshape(-1, 4, 3, 3), padding=1, groups=b)
        return out.reshape(b, 5, 6, 6)


class Heads(nn.Module):
    """Several outputs: a dict, an integer leaf, and a leaf that does not depend on z."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, z):
        h = self.norm(self.a(z))
        gate = torch.where(h > 0, h, 0.1 * h)
        return {"image": F.gelu(gate) @ self.a.weight, "index": h.argmax(-1), "constant": self.a.bias * 2,
                "stats": F.pad(F.elu(h), (1, 1), value=3.0).mean(0) - F.softplus(h).sum(), "tanh": torch.tanh(h)[..., 1:]}


class BatchNormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.LeakyReLU(0.2, inplace=True),
                                    nn.Unflatten(1, (2, 2, 2)), nn.ConvTranspose2d(2, 3, 3, stride=2), nn.InstanceNorm2d(3),
                                    nn.Hardtanh(-0.5, 0.5), nn.PixelShuffle(1), nn.ZeroPad2d(1), nn.Sigmoid(), nn.Flatten(),
                                    nn.Dropout(0.3), nn.Linear(3 * 7 * 7, 2), nn.ReLU6())

    def forward(self, z):
        return self.layers(z)


@pytest.mark.parametrize("make, shape", [(Residual, (2, 4, 5, 5)), (Modulated, (2, 3)), (BatchNormed, (6, 3))],
                         ids=["residual", "modulated", "batchnormed"])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_a_program_gives_double_backwards_tangent(make, shape, mode):
    torch.manual_seed(0)
    G = make().double().train(mode == "train")
    if make is BatchNormed and mode == "train":
        G.layers[11].eval()  # dropout draws random numbers: refused in training mode (tested below)
    assert_program_matches(G, torch.randn(shape, dtype=torch.float64) + 0.5)


def test_pytree_outputs_integer_leaves_and_constant_leaves():
    torch.manual_seed(0)
    G = Heads().double()
    z = torch.randn(5, 4, dtype=torch.float64)
    v = torch.randn(5, 4, dtype=torch.float64)
    primals, tangents = program_jvp(G, [z], [v])
    program = write(G, [z])
    out = G(z)
    keys = list(out)  # a dict flattens in insertion order
    assert program.spec.num_leaves == len(keys)
    by_key = dict(zip(keys, zip(primals, tangents)))
    assert by_key["index"][1] is None and torch.equal(by_key["index"][0], out["index"])
    assert torch.equal(by_key["constant"][1], torch.zeros(6, dtype=torch.float64))
    for key in ("image", "stats", "tanh"):
        _, expected = torch.autograd.functional.jvp(lambda z_: G(z_)[key], (z,), (v,))
        assert torch.allclose(by_key[key][1], expected, atol=1e-12), key


@pytest.mark.parametrize("name", sorted(mixedad.zoo.MEMBERS))
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_zoo_members_have_a_program_or_say_why_not(name, mode):
    G = mixedad.zoo.MEMBERS[name](dtype=torch.float64).train(mode == "train")
    z = torch.randn(*mixedad.zoo.latent_shape(G, 3), dtype=torch.float64)
    unsupported = {"transformer_layer": "TransformerEncoderLayer", "stylegan2_ada": "custom torch.autograd.Function"}
    if name in unsupported:
        with pytest.raises(Unsupported, match=unsupported[name]):
            write(G, [z])
        return
    if mode == "train" and any(isinstance(m, nn.Dropout) for m in G.modules()):
        pytest.skip("dropout in training mode is refused")
    attends = name == "transformer_sdpa"  # SDPA's primal from the tangent's blocks on the CPU
    assert_program_matches(G, z, primal_rtol=1e-13 if attends else 0.0)


def test_the_program_keeps_buffers_as_one_forward_does():
    torch.manual_seed(0)
    G = BatchNormed().double().train()
    G.layers[11].eval()
    z = torch.randn(6, 3, dtype=torch.float64)
    program = write(G, [z])
    before = {k: b.clone() for k, b in G.state_dict().items()}
    assert all(torch.equal(before[k], b) for k, b in G.state_dict().items()), "writing leaves buffers alone"
    with torch.no_grad():
        program(z, torch.randn(6, 3, dtype=torch.float64))
    after_program = {k: b.clone() for k, b in G.state_dict().items()}
    G.load_state_dict(before)
    with torch.no_grad():
        G(z)
    assert all(torch.equal(after_program[k], b) for k, b in G.state_dict().items())


def test_reverse_mode_reference_helper_is_itself_double_backward():
    G = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    z, v = torch.randn(3, 2), torch.randn(3, 2)
    out, t = reverse_mode_jvp(G, [z], [v])
    _, expected = torch.func.jvp(G, (z,), (v,))
    assert torch.allclose(t, expected)
