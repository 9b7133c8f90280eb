"""mixed_grad and the reference leave the user's objects exactly as they were."""
import pytest
import torch

import mixedad
from mixedad import zoo
from mixedad.reference import double_backward_mixed_grad

F64 = torch.float64


def snapshot(G):
    return {
        "requires_grad": {n: p.requires_grad for n, p in G.named_parameters()},
        "grad": {n: p.grad for n, p in G.named_parameters()},
        "params": {n: p.detach().clone() for n, p in G.named_parameters()},
        "buffers": {n: b.clone() for n, b in G.named_buffers()},
        "training": {n: m.training for n, m in G.named_modules()},
    }


def assert_same(before, after):
    assert before["requires_grad"] == after["requires_grad"]
    assert all(after["grad"][n] is before["grad"][n] for n in before["grad"])
    for key in ("params", "buffers"):
        assert before[key].keys() == after[key].keys()
        for n in before[key]:
            assert torch.equal(before[key][n], after[key][n]), f"{key} {n} changed"
    assert before["training"] == after["training"]


@pytest.mark.parametrize("fn", [mixedad.mixed_grad, double_backward_mixed_grad])
@pytest.mark.parametrize("create_graph", [False, True])
def test_generator_and_inputs_untouched(fn, create_graph):
    G = zoo.dcgan(latent_dim=6, channels=4, image_size=8, seed=3, dtype=F64)
    # A mix of frozen and trainable parameters, and a half-train, half-eval module tree.
    G[1].weight.requires_grad_(False)
    G[-2].train()
    G[-2].weight.grad = torch.ones_like(G[-2].weight)
    z = torch.randn(2, 6, dtype=F64, requires_grad=True)
    y_trainable = torch.randn(2, 3, 8, 8, dtype=F64, requires_grad=True)
    y_trainable.grad = torch.full_like(y_trainable, 7.0)
    y_frozen = torch.randn(3, 8, 8, dtype=F64)
    y_values = (y_trainable.detach().clone(), y_frozen.clone())
    before = snapshot(G)
    rng = torch.get_rng_state()

    def f(y, g):
        return ((y[0] + g) ** 3).sum() + (y[1] * g).sum()

    fn(f, G, z, (y_trainable, y_frozen), create_graph=create_graph)

    assert_same(before, snapshot(G))
    assert torch.equal(torch.get_rng_state(), rng)
    assert z.requires_grad and z.grad is None
    assert y_trainable.requires_grad and not y_frozen.requires_grad
    assert torch.equal(y_trainable.grad, torch.full_like(y_trainable, 7.0))
    assert y_frozen.grad is None
    assert torch.equal(y_trainable.detach(), y_values[0]) and torch.equal(y_frozen, y_values[1])


def test_mixed_grad_builds_no_graph_through_G():
    """With create_graph=True the result's graph reaches y but no parameter of G."""
    G = zoo.mlp(3, 8, seed=4, dtype=F64)
    z = torch.randn(4, 8, dtype=F64)
    y = torch.randn(4, 8, dtype=F64, requires_grad=True)
    result = mixedad.mixed_grad(lambda y, g: ((y + g) ** 3).sum(), G, z, y, create_graph=True)
    params = list(G.parameters())
    grads = torch.autograd.grad(result.sum(), [y] + params, allow_unused=True)
    assert grads[0] is not None
    assert all(g is None for g in grads[1:])
