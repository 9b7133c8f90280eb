"""G as segments: the split, the boundaries, and the sweeps against torch.func in float64."""
import pytest
import torch
from torch import nn

import mixedad
from mixedad._curvature import segments as S
from mixedad.testing import assert_close

F64 = torch.float64


def test_split_of_a_sequential_and_of_other_callables():
    G = nn.Sequential(*[nn.Linear(2, 2) for _ in range(10)])
    parts = S.split("test", G, "auto")
    assert len(parts) == 2 and sum(len(p) for p in parts) == 10  # sqrt(10 / 2) slices, every module once
    assert [S.auto_count(n) for n in (2, 8, 16, 64, 128)] == [1, 2, 3, 6, 8]
    assert len(S.split("test", G, 3)) == 3 and len(S.split("test", G, 99)) == 10
    f = lambda z: z  # noqa: E731
    assert S.split("test", f, "auto") == [f]
    with pytest.raises(TypeError, match="slices an nn.Sequential"):
        S.split("test", f, 2)
    with pytest.raises(ValueError, match="at least one segment"):
        S.split("test", f, [])
    with pytest.raises(ValueError, match="expected segments="):
        S.split("test", f, "sqrt")


def test_a_middle_segment_must_return_tensors():
    with pytest.raises(TypeError, match="segment 0 returned"):
        S.Chain("test", [lambda z: (z, 3), lambda h, k: h], (torch.ones(2, dtype=F64),))


def _problem():
    G = mixedad.zoo.mlp(3, 4, dtype=F64)
    gen = torch.Generator().manual_seed(0)
    z, y = torch.randn(2, 4, generator=gen, dtype=F64), torch.randn(2, 4, generator=gen, dtype=F64)
    f = lambda y, g: ((g - y) ** 2).sum() + (torch.sin(g) * y).sum()  # noqa: E731
    return f, G, z, y


def test_gradient_pull_and_hessian_sweeps_against_torch_func():
    f, G, z, y = _problem()
    chain = S.Chain("test", S.split("test", G, 3), (z,))
    y_leaves, y_spec = [y], torch.utils._pytree.tree_flatten(y)[1]
    lam, _ = S.f_derivatives("test", f, y_leaves, y_spec, chain.output, chain.spec)
    assert_close(chain.gradient(lam)[0], torch.func.grad(lambda q: f(y, G(q)))(z), rtol=1e-12)
    us = [torch.randn(3, *z.shape, dtype=F64)]
    tangents, g_leaves = chain.tangents(us)
    assert len(tangents) == 4 and torch.allclose(g_leaves[0], G(z))
    _, mu = S.f_derivatives("test", f, y_leaves, y_spec, g_leaves, chain.spec, tangents[-1])
    gradient, hessian_products = chain.hessian(lam, mu, tangents)
    H = torch.func.hessian(lambda q: f(y, G(q)))(z).reshape(8, 8).detach()
    assert_close(hessian_products[0], (us[0].reshape(3, 8) @ H.T).reshape(3, 2, 4), rtol=1e-11)
    assert_close(gradient[0], torch.func.grad(lambda q: f(y, G(q)))(z), rtol=1e-12)
    J = torch.func.jacrev(G)(z).reshape(8, 8).detach()
    pulled = chain.pull([us[0]])[0]
    assert_close(pulled, (us[0].reshape(3, 8) @ J).reshape(3, 2, 4), rtol=1e-12)


def test_push_batches_tangents_or_goes_one_by_one():
    G = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh()).to(F64).train()  # a batch cannot take it
    z, vs = torch.randn(5, 3, dtype=F64), torch.randn(2, 5, 3, dtype=F64)
    stats = G[1].running_mean.clone()
    g_leaves, tangents, _ = S.push("test", G, (z,), [vs])
    G[1].running_mean.copy_(stats)
    assert tangents[0].shape == (2, 5, 4) and g_leaves[0].shape == (5, 4)
    expected = torch.stack([torch.func.jvp(lambda q: torch.func.functional_call(G, dict(G.named_parameters()) |
                                                                                 {n: b.clone() for n, b in
                                                                                  G.named_buffers()}, (q,)),
                                           (z,), (v,))[1] for v in vs])
    assert_close(tangents[0], expected.detach(), rtol=1e-12)
