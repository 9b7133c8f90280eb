"""Every zoo generator against double backward, in eval and in train mode (same RNG state).

Train mode: dropout masks agree between mixedad and the reference computed from the same RNG
state, BatchNorm running statistics end as after one plain train-mode forward, the RNG ends as
after that forward, and no buffer ever holds a dual tensor.
"""
import copy

import pytest
import torch
from torch.autograd import forward_ad

import mixedad
from mixedad import zoo
from mixedad.reference import double_backward_input_grad, double_backward_mixed_grad
from mixedad.testing import assert_close

F64 = torch.float64
DROPOUT = {"mlp": {"dropout": 0.3}, "transformer_layer": {"dropout": 0.2}, "transformer_sdpa": {"dropout": 0.2}}


def build(name, device, train):
    G = zoo.MEMBERS[name](dtype=F64, device=device, **(DROPOUT.get(name, {}) if train else {}))
    return G.train() if train else G


def inputs(G, device, batch=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(zoo.latent_shape(G, batch), generator=gen, dtype=F64).to(device)
    with torch.no_grad():
        g_shape = copy.deepcopy(G).eval()(z).shape
    y = torch.randn(g_shape, generator=gen, dtype=F64).to(device)
    v = torch.randn(z.shape, generator=gen, dtype=F64).to(device)
    return z, y, v


def f(y, g):
    return ((y + g) ** 3).sum() + (torch.sin(y) * g ** 2).sum()


def rng_state(device):
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


def buffers(G):
    return {k: b.clone() for k, b in G.named_buffers()}


def assert_same_buffers(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-12, atol=0), k


def watch_dual_buffers(G):
    """Forward hooks recording any buffer that holds a forward-mode tangent after a module runs."""
    seen = []

    def hook(module, args, output):
        for name, buf in module.named_buffers(recurse=False):
            if forward_ad.unpack_dual(buf).tangent is not None:
                seen.append(f"{type(module).__name__}.{name}")

    handles = [m.register_forward_hook(hook) for m in G.modules()]
    return seen, handles


@pytest.mark.parametrize("name", sorted(zoo.MEMBERS))
def test_eval_mode_matches_double_backward(name, device):
    G = build(name, device, train=False)
    z, y, v = inputs(G, device)
    expected = double_backward_mixed_grad(f, G, z, y, v)
    assert_close(mixedad.mixed_grad(f, G, z, y, v), expected, what=name)
    assert expected.abs().max() > 1e-3


@pytest.mark.parametrize("name", sorted(zoo.MEMBERS))
def test_train_mode_matches_reference_from_same_rng_and_updates_state_once(name, device):
    G = build(name, device, train=True)
    z, y, v = inputs(G, device)
    ours_G, ref_G, plain_G = G, copy.deepcopy(G), copy.deepcopy(G)
    seen, handles = watch_dual_buffers(ours_G)

    torch.manual_seed(123)
    ours = mixedad.mixed_grad(f, ours_G, z, y, v)
    rng_ours = rng_state(device)
    torch.manual_seed(123)
    expected = double_backward_mixed_grad(f, ref_G, z, y, v)
    torch.manual_seed(123)
    with torch.no_grad(), mixedad._frontend.tangents.differentiable_attention():
        plain_G(z)  # one plain train-mode forward: what the state should look like afterwards
    rng_plain = rng_state(device)
    for h in handles:
        h.remove()

    assert_close(ours, expected, what=f"{name} in train mode")
    assert ours_G.training and all(m.training for m in ours_G.modules())
    assert_same_buffers(buffers(ours_G), buffers(plain_G))
    assert torch.equal(rng_ours, rng_plain)
    assert not seen, f"buffers held dual tensors: {seen}"


@pytest.mark.parametrize("name", ["mlp", "dcgan", "resnet_batchnorm", "transformer_sdpa"])
def test_train_mode_input_grad_replays_masks_and_keeps_stats(name, device):
    """input_grad's backward replays each chunk's dropout masks and leaves BatchNorm alone."""
    G = build(name, device, train=True)
    z, y, _ = inputs(G, device, batch=5)
    y = y[0]  # one target shared by all latent codes, broadcast over each chunk
    x = torch.randn(z.shape[-1], 2, dtype=F64, device=device)

    def step(make, G_):
        y_ = y.clone().requires_grad_()
        x_ = x.clone().requires_grad_()
        torch.manual_seed(7)
        (torch.tanh(make(f, G_, z, y_, chunk_size=2) @ x_) ** 2).sum().backward()
        return (y_.grad, x_.grad), rng_state(device), buffers(G_)

    ours, rng_ours, buf_ours = step(mixedad.input_grad, G)
    naive, rng_naive, buf_naive = step(double_backward_input_grad, copy.deepcopy(build(name, device, train=True)))
    assert_close(ours, naive, what=f"{name} input_grad in train mode")
    assert torch.equal(rng_ours, rng_naive)
    assert_same_buffers(buf_ours, buf_naive)


def test_dropout_really_is_random_in_these_tests():
    """Guard: with another seed the masks, and so the results, differ."""
    G = build("mlp", "cpu", train=True)
    z, y, v = inputs(G, "cpu")
    torch.manual_seed(1)
    a = mixedad.mixed_grad(f, G, z, y, v)
    torch.manual_seed(2)
    b = mixedad.mixed_grad(f, G, z, y, v)
    assert not torch.allclose(a, b)


def test_batchnorm_stats_really_change_in_these_tests():
    G = build("dcgan", "cpu", train=True)
    z, y, v = inputs(G, "cpu")
    before = buffers(G)
    mixedad.mixed_grad(f, G, z, y, v)
    after = buffers(G)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert int(after["2.num_batches_tracked"]) == int(before["2.num_batches_tracked"]) + 1


def test_generator_wrapped_in_a_lambda_still_updates_stats_once():
    """G need not be an nn.Module: modules it calls are found as they run and restored after replays."""
    model = build("dcgan", "cpu", train=True)
    naive_model = copy.deepcopy(model)
    z, y, _ = inputs(model, "cpu", batch=4)
    y = y[0]

    def step(make, m):
        y_ = y.clone().requires_grad_()
        torch.manual_seed(11)
        (make(f, lambda code: m(code), z, y_, chunk_size=2) ** 2).sum().backward()
        return y_.grad, buffers(m)

    ours, buf_ours = step(mixedad.input_grad, model)
    naive, buf_naive = step(double_backward_input_grad, naive_model)
    assert_close(ours, naive)
    assert_same_buffers(buf_ours, buf_naive)
