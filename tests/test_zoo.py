"""The generator zoo: deterministic, RNG-neutral, correctly shaped."""
import pytest
import torch

from mixedad import zoo


@pytest.mark.parametrize("build, batch, out_shape", [
    (lambda: zoo.mlp(3, 8, in_features=5, out_features=7), 4, (4, 7)),
    (lambda: zoo.dcgan(latent_dim=6, channels=4, image_size=16, extra_blocks=2), 2, (2, 3, 16, 16)),
])
def test_shapes_seed_and_rng(build, batch, out_shape):
    state = torch.get_rng_state()
    G1, G2 = build(), build()
    assert torch.equal(torch.get_rng_state(), state)
    assert not G1.training
    for p1, p2 in zip(G1.state_dict().values(), G2.state_dict().values()):
        assert torch.equal(p1, p2)
    z = torch.randn(zoo.latent_shape(G1, batch))
    with torch.no_grad():
        assert G1(z).shape == out_shape


def test_seeds_differ_and_batchnorm_stats_are_random():
    a, b = zoo.dcgan(seed=0), zoo.dcgan(seed=1)
    assert not torch.equal(a[1].weight, b[1].weight)
    assert not torch.equal(a[2].running_mean, torch.zeros_like(a[2].running_mean))


@pytest.mark.parametrize("call, pattern", [
    (lambda: zoo.mlp(0), r"zoo.mlp: expected depth >= 1, got 0"),
    (lambda: zoo.mlp(2, activation="sigmoid"), r"zoo.mlp: expected activation in .* got 'sigmoid'"),
    (lambda: zoo.dcgan(image_size=12), r"zoo.dcgan: expected image_size a power of two >= 8, got 12"),
])
def test_bad_arguments(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


@pytest.mark.parametrize("activation", ["tanh", "relu", "leaky_relu", "softplus"])
def test_deep_mlp_jacobian_neither_vanishes_nor_explodes(activation):
    """Calibration keeps J_G v at unit scale, so deep-network derivatives are not numerically zero."""
    G = zoo.mlp(64, 128, activation=activation, dtype=torch.float64)
    z, v = torch.randn(32, 128, dtype=torch.float64), torch.randn(32, 128, dtype=torch.float64)
    with torch.no_grad():
        _, jv = torch.func.jvp(G, (z,), (v,))
    assert 0.2 < jv.std().item() < 5.0


def test_deep_dcgan_jacobian_neither_vanishes_nor_explodes():
    G = zoo.dcgan(latent_dim=16, channels=4, image_size=16, extra_blocks=8, dtype=torch.float64)
    z, v = torch.randn(4, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64)
    with torch.no_grad():
        _, jv = torch.func.jvp(G, (z,), (v,))
    assert 0.1 < jv.std().item() < 10.0
