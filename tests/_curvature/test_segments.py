"""G as segments: the split, the boundaries, and the sweeps against torch.func in float64."""
import warnings

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


def _hessian(f, G, z, y):
    return torch.func.hessian(lambda q: f(y, G(q)))(z).reshape(z.numel(), z.numel()).detach()


def _eval_chain(width=4, depth=6):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.BatchNorm1d(width), nn.Tanh()]
    G = nn.Sequential(*layers).to(F64).eval()
    gen = torch.Generator().manual_seed(1)
    for m in G.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.running_mean.copy_(torch.randn(width, generator=gen, dtype=F64))
            m.running_var.copy_(torch.rand(width, generator=gen, dtype=F64) + 0.5)
    z, y = torch.randn(3, width, generator=gen, dtype=F64), torch.randn(3, width, generator=gen, dtype=F64)
    f = lambda y, g: ((g - y) ** 2).sum() + (torch.sin(g) * y).sum()  # noqa: E731
    return f, G, z, y


def test_slices_of_an_untouched_eval_g_share_the_records_of_gs_snapshot():
    """No second copy of the buffers per segment: each slice's snapshot is G's records and the random state then;
    the products are exact, in either kind, and G's buffers are not written."""
    f, G, z, y = _eval_chain()
    buffers = {n: (b, b._version) for n, b in G.named_buffers()}
    for kind in ("hessian", "ggn"):
        op = mixedad.z_curvature(f, G, z, y, kind=kind, segments=3, damping=0.0)
        assert [type(s).__name__ for s in op._chain.snapshots] == ["_Part"] * 3
        assert all(len(s.saved) == 0 for s in op._chain.snapshots)
        if kind == "hessian":
            assert_close(op.dense(), _hessian(f, G, z, y), rtol=1e-10)
        else:
            assert op.dense().shape == (12, 12)
    assert all(b is dict(G.named_buffers())[n] and b._version == v for n, (b, v) in buffers.items())


class _Counting(nn.Module):
    """A module whose forward counts its calls and scales by the count: it is shared by two segments."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * (1.0 + 0.1 * self.calls)


def test_a_module_changed_by_an_earlier_segment_gets_a_snapshot_of_its_own():
    """A module shared by segments 1 and 3 is not what G's snapshot recorded when segment 3 starts: that segment
    takes its own snapshot, and every sweep replays the count each segment saw."""
    f, G, z, y = _eval_chain(depth=2)
    counting = _Counting()
    G = nn.Sequential(G[0], counting, G[1], G[2], counting, G[3:]).to(F64).eval()
    kinds = [type(s).__name__ for s in mixedad.z_curvature(f, G, z, y, segments=6)._chain.snapshots]
    assert kinds[:4] == ["_Part"] * 4 and kinds[4] == "Snapshot"
    counting.calls = 0
    op = mixedad.z_curvature(f, G, z, y, kind="hessian", segments=6, damping=0.0)
    assert counting.calls == 0  # as the caller had it: the construction is undone like a replay
    dense = op.dense()
    assert counting.calls == 0

    def naive(q):
        counting.calls = 0
        return f(y, G(q))

    assert_close(dense, torch.func.hessian(naive)(z).reshape(12, 12).detach(), rtol=1e-10)


def test_a_segment_with_a_backward_hook_still_takes_the_hooked_route():
    """The shared snapshot lists the segment's modules, so a backward hook inside one is seen: the Hessian's
    products, whose tangents go segment by segment, are double backward's (the hook doubles the gradient through
    the segment's Linear), not forward mode's."""
    f, G, z, y = _eval_chain(depth=3)
    u = torch.randn_like(z)
    plain = mixedad.z_curvature(f, G, z, y, kind="hessian", segments=3, damping=0.0) @ u
    handle = G[4].register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 2.0,))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "mixedad: a module of G has backward hooks", RuntimeWarning)
            op = mixedad.z_curvature(f, G, z, y, kind="hessian", segments=3, damping=0.0)
            assert [type(s).__name__ for s in op._chain.snapshots] == ["_Part"] * 3
            product = op @ u
        zz = z.detach().requires_grad_()
        (gradient,) = torch.autograd.grad(f(y, G(zz)), zz, create_graph=True)
        (expected,) = torch.autograd.grad(gradient, zz, u)
    finally:
        handle.remove()
    assert_close(product, expected, rtol=1e-10)
    assert (product - plain).norm() > 0.1 * plain.norm()  # the hook matters here


def test_only_segments_that_write_their_input_take_a_copy_of_their_boundary():
    """A slice that starts with an in-place activation writes its input: its recomputation takes a copy (the
    boundary stays as kept), and the products are exact; the others take none, so no copy is in the peak."""
    f, G, z, y = _eval_chain(depth=3)
    G = nn.Sequential(*G[0:4], nn.ReLU(inplace=True), *G[4:7], nn.ReLU(inplace=True), G[8])  # each after a Linear
    op = mixedad.z_curvature(f, G, z, y, kind="hessian", segments=[G[0:4], G[4:8], G[8:10]], damping=0.0)
    assert op._chain.writes == [False, True, True]
    kept = [s[0].clone() for s in op._chain.states]
    assert_close(op.dense(), _hessian(f, G, z, y), rtol=1e-10)
    assert all(torch.equal(a, s[0]) for a, s in zip(kept, op._chain.states))


class _WritesWithGrad(nn.Module):
    def forward(self, x):
        if torch.is_grad_enabled():
            with torch.no_grad():
                x.mul_(1.0)
        return x * 2


def test_a_segment_that_writes_its_input_only_in_a_sweep_is_refused():
    f, G, z, y = _eval_chain(depth=2)
    G = nn.Sequential(*G[:3], _WritesWithGrad(), *G[3:]).to(F64).eval()
    op = mixedad.z_curvature(f, G, z, y, kind="ggn", segments=[G[:3], G[3:]], damping=0.0)
    assert op._chain.writes == [False, False]
    with pytest.raises(RuntimeError, match=r"^z_curvature\(f, G, z, y\): segment 1 wrote its input in place in a sweep"):
        op @ torch.randn_like(z)
