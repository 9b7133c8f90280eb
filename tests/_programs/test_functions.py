"""Each tangent function a program calls, against double backward (float64), one layer or op at a time."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._programs.common import assert_program_matches

D = torch.float64

LAYERS = {
    "linear": (lambda: nn.Linear(4, 3), (5, 4)),
    "conv1d": (lambda: nn.Conv1d(2, 3, 3, padding=1, dilation=1), (2, 2, 7)),
    "conv2d_circular": (lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular", groups=1), (2, 2, 5, 5)),
    "conv3d": (lambda: nn.Conv3d(2, 2, 2), (1, 2, 3, 3, 3)),
    "conv_transpose1d": (lambda: nn.ConvTranspose1d(2, 3, 3, stride=2), (2, 2, 4)),
    "conv_transpose2d_groups": (lambda: nn.ConvTranspose2d(4, 4, 3, stride=2, output_padding=1, groups=2),
                                (2, 4, 3, 3)),
    "conv2d_unbatched": (lambda: nn.Conv2d(2, 3, 3), (2, 5, 5)),
    "batch_norm_eval": (lambda: nn.BatchNorm2d(3).eval(), (4, 3, 2, 2)),
    "batch_norm_train": (lambda: nn.BatchNorm2d(3).train(), (4, 3, 2, 2)),
    "batch_norm_no_stats": (lambda: nn.BatchNorm1d(3, track_running_stats=False).eval(), (5, 3)),
    "batch_norm_no_affine": (lambda: nn.BatchNorm1d(3, affine=False).train(), (5, 3, 2)),
    "instance_norm_affine": (lambda: nn.InstanceNorm2d(3, affine=True), (2, 3, 4, 4)),
    "group_norm": (lambda: nn.GroupNorm(2, 4), (3, 4, 5)),
    "layer_norm": (lambda: nn.LayerNorm([3, 2]), (4, 3, 2)),
    "layer_norm_no_affine": (lambda: nn.LayerNorm(5, elementwise_affine=False), (2, 5)),
    "relu": (lambda: nn.ReLU(), (3, 4)),
    "leaky_relu": (lambda: nn.LeakyReLU(0.1), (3, 4)),
    "leaky_relu_negative_slope": (lambda: nn.LeakyReLU(-0.3), (3, 4)),
    "tanh": (lambda: nn.Tanh(), (3, 4)),
    "sigmoid": (lambda: nn.Sigmoid(), (3, 4)),
    "gelu": (lambda: nn.GELU(), (3, 4)),
    "gelu_tanh": (lambda: nn.GELU("tanh"), (3, 4)),
    "silu": (lambda: nn.SiLU(), (3, 4)),
    "elu": (lambda: nn.ELU(0.7), (3, 4)),
    "softplus": (lambda: nn.Softplus(2.0, 1.0), (3, 4)),
    "hardtanh": (lambda: nn.Hardtanh(-0.3, 0.4), (3, 4)),
    "relu6": (lambda: nn.ReLU6(), (3, 4)),
    "upsample_bicubic": (lambda: nn.Upsample(scale_factor=2, mode="bicubic"), (1, 2, 3, 3)),
    "pixel_unshuffle": (lambda: nn.PixelUnshuffle(2), (1, 1, 4, 4)),
    "constant_pad": (lambda: nn.ConstantPad2d(1, 2.5), (1, 2, 3, 3)),
    "replication_pad": (lambda: nn.ReplicationPad1d(2), (1, 2, 3)),
    "identity": (lambda: nn.Identity(), (2, 3)),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer(name):
    make, shape = LAYERS[name]
    torch.manual_seed(0)
    layer = make().to(D)
    assert_program_matches(nn.Sequential(layer, nn.Identity()), torch.randn(shape, dtype=D) * 2)


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, z):
        return self.fn(z)


FUNCTIONS = {
    "exp_sqrt_rsqrt_abs_pow": lambda z: torch.exp(z).sqrt() + torch.rsqrt(z.abs() + 1) + z.pow(3) + z ** -2.0,
    "pow_zero": lambda z: z.pow(0) + z,
    "sub_neg_div": lambda z: (-(z - 1.5) / (z * z + 1)) - (2 / (z.abs() + 1)),
    "matmul": lambda z: z @ z.transpose(0, 1) + torch.matmul(z, torch.ones(z.shape[1], 3, dtype=z.dtype)) + z @ z.mT,
    "stack_split": lambda z: torch.stack(torch.split(z, 2, dim=1), dim=0).sum(0) * torch.unbind(z, 1)[0][:, None],
    "getitem_expand": lambda z: z[1:, None, ::2].expand(-1, 3, -1).permute(2, 0, 1).contiguous().view(-1),
    "where_constant_branch": lambda z: torch.where(z > 0, z * 2, torch.zeros_like(z)),
    "functional_activations": lambda z: F.leaky_relu(z, 0.3) + F.elu(z, alpha=0.5) + F.softplus(z, beta=2.0)
    + F.hardtanh(z, -0.5, 0.5) + F.silu(z) + F.gelu(z, approximate="tanh") + torch.sigmoid(z) + z.relu() + z.tanh(),
    "interpolate_pad": lambda z: F.pad(F.interpolate(z[None], scale_factor=2, mode="linear"), (1, 2), mode="reflect"),
    "reductions": lambda z: z.sum(dim=1, keepdim=True) * z.mean() + torch.flatten(z).sum(),
    "broadcast_with_a_constant": lambda z: z[0] + torch.ones(3, 1, dtype=z.dtype) * 2,
    "detach": lambda z: z * z.detach() + (z - z.detach()),
    "addmm": lambda z: torch.addmm(z[:, :2].sum(0), z, z.T[:, :2]) + torch.addmm(z[0, :2], z[:, :2], z[:2, :2],
                                                                                 beta=0.5, alpha=2.0),
}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mask", [None, "bool", "additive", "far_negative"])
def test_attention(causal, mask):
    torch.manual_seed(0)
    T = 9
    masks = {None: None, "bool": torch.rand(T, T) > 0.3, "additive": torch.randn(T, T, dtype=D),
             "far_negative": torch.zeros(T, T, dtype=D).masked_fill_(torch.rand(T, T) > 0.5, torch.finfo(D).min)}
    if masks[mask] is not None:
        masks[mask][2] = False if mask == "bool" else float("-inf")  # a query row that sees no key
    if causal and mask is not None:
        pytest.skip("SDPA refuses is_causal with a mask")

    class Attend(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24)
            self.register_buffer("mask", masks[mask])

        def forward(self, x):
            q, k, v = self.qkv(x).reshape(2, T, 3, 2, 4).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=causal)

    assert_program_matches(Attend().to(D), torch.randn(2, T, 8, dtype=D), primal_rtol=1e-13)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_function(name):
    torch.manual_seed(0)
    assert_program_matches(_Fn(FUNCTIONS[name]), torch.rand(3, 4, dtype=D) + 0.5)


def test_linear_and_convolution_functions_with_tangent_weights_and_biases():
    class Hyper(nn.Module):
        def forward(self, z):
            w = z[:6].reshape(2, 3)
            x = z[6:].reshape(1, 2, 3)
            return F.linear(x, w, z[:2]).sum() + F.conv1d(x, w[:, :, None].expand(-1, -1, 2).transpose(0, 1)
                                                          .contiguous(), z[:3], padding=1)[..., :3]

    assert_program_matches(Hyper(), torch.randn(12, dtype=D))

    class Unbatched(nn.Module):  # the bias of an unbatched convolution broadcasts over (C, H, W)
        def forward(self, z):
            return F.conv2d(z[:18].reshape(2, 3, 3), z[18:26].reshape(2, 2, 2, 1), z[26:28])

    assert_program_matches(Unbatched(), torch.randn(28, dtype=D))
