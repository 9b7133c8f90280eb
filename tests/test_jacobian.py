"""mixed_grad under torch.func.vmap, and mixed_jacobian, against double backward."""
import pytest
import torch

import mixedad
from mixedad import zoo
from mixedad.reference import double_backward_mixed_grad, double_backward_mixed_jacobian, finite_difference_mixed_grad
from mixedad.testing import assert_close

F64 = torch.float64


def cubic(y, g):
    return ((y + g) ** 3).sum() + (torch.sin(y) * g).sum()


def problem():
    gen = torch.Generator().manual_seed(0)
    G = zoo.mlp(3, 6, seed=3, dtype=F64)
    z, y = (torch.randn(4, 6, generator=gen, dtype=F64) for _ in range(2))
    return G, z, y


def test_vmap_over_v_equals_a_loop():
    G, z, y = problem()
    V = torch.randn(5, *z.shape, dtype=F64)
    batched = torch.func.vmap(lambda v: mixedad.mixed_grad(cubic, G, z, y, v))(V)
    loop = torch.stack([mixedad.mixed_grad(cubic, G, z, y, v) for v in V])
    ref = torch.stack([double_backward_mixed_grad(cubic, G, z, y, v) for v in V])
    assert_close(batched, loop)
    assert_close(batched, ref)


def test_vmap_with_pytree_y_and_chunk_size():
    G, z, _ = problem()
    y = {"a": torch.randn(6, dtype=F64), "b": (torch.randn(4, 6, dtype=F64),)}
    f = lambda y, g: ((g * y["a"] + y["b"][0]) ** 3).sum()  # noqa: E731
    V = torch.randn(7, *z.shape, dtype=F64)
    batched = torch.func.vmap(lambda v: mixedad.mixed_grad(f, G, z, y, v), chunk_size=3)(V)
    for i, v in enumerate(V):
        assert_close(torch.utils._pytree.tree_map(lambda t: t[i], batched), double_backward_mixed_grad(f, G, z, y, v))


@pytest.mark.parametrize("chunk_size", [None, 1, 5, 24, 1000])
def test_mixed_jacobian_matches_double_backward(chunk_size):
    G, z, y = problem()
    jac = mixedad.mixed_jacobian(cubic, G, z, y, chunk_size=chunk_size)
    assert jac.shape == z.shape + y.shape
    assert_close(jac, double_backward_mixed_jacobian(cubic, G, z, y))


def test_mixed_jacobian_contracts_to_mixed_grad_and_finite_differences():
    G, z, y = problem()
    v = torch.randn_like(z)
    jac = mixedad.mixed_jacobian(cubic, G, z, y, chunk_size=8)
    contracted = torch.tensordot(v, jac, dims=z.dim())
    assert_close(contracted, mixedad.mixed_grad(cubic, G, z, y, v))
    assert_close(contracted, finite_difference_mixed_grad(cubic, G, z, y, v), rtol=1e-6)


def test_mixed_jacobian_shapes_of_different_rank():
    G = lambda z: torch.tanh(z).sum(0)  # noqa: E731  z (2, 3) -> g (3,)
    f = lambda y, g: (y.sum() * g ** 2).sum() + (y[0, 0] * g).sum()  # noqa: E731  y (4, 5)
    z, y = torch.randn(2, 3, dtype=F64), torch.randn(4, 5, dtype=F64)
    jac = mixedad.mixed_jacobian(f, G, z, y)
    assert jac.shape == (2, 3, 4, 5)
    assert_close(jac, double_backward_mixed_jacobian(f, G, z, y))


def _rows_by_double_backward(f, G, zs, y_leaves, y_of):
    """Every row of the mixed Jacobian by double backward, one per entry of the z's (in order): per leaf of y."""
    zs = [z.detach().clone().requires_grad_() for z in zs]
    ys = [leaf.detach().clone().requires_grad_() for leaf in y_leaves]
    grads = torch.autograd.grad(f(y_of(ys), G(*zs)), zs, create_graph=True)
    flat = torch.cat([g.reshape(-1) for g in grads])
    rows = [torch.autograd.grad(flat[i], ys, retain_graph=True, allow_unused=True) for i in range(flat.numel())]
    return [torch.stack([torch.zeros_like(ys[j]) if r[j] is None else r[j] for r in rows]) for j in range(len(ys))]


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_mixed_jacobian_takes_a_pytree_y_and_a_tuple_z_as_mixed_grad_does(chunk_size):
    W = torch.randn(4, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    G = lambda a, b: torch.tanh(a @ W + b)  # noqa: E731
    f = lambda y, g: ((y["a"] * g) ** 3).sum() + (y["b"][0] * g).sum() ** 2  # noqa: E731
    gen = torch.Generator().manual_seed(2)
    z = (torch.randn(2, 4, generator=gen, dtype=F64), torch.randn(4, generator=gen, dtype=F64))
    y = {"a": torch.randn(2, 4, generator=gen, dtype=F64), "b": [torch.randn(4, generator=gen, dtype=F64)]}
    jac = mixedad.mixed_jacobian(f, G, z, y, chunk_size=chunk_size)
    rows_a, rows_b = _rows_by_double_backward(f, G, z, [y["a"], y["b"][0]], lambda ys: {"a": ys[0], "b": [ys[1]]})
    assert isinstance(jac, tuple) and jac[0]["a"].shape == (2, 4, 2, 4) and jac[1]["b"][0].shape == (4, 4)
    assert_close(torch.cat([jac[0]["a"].reshape(8, 2, 4), jac[1]["a"].reshape(4, 2, 4)]), rows_a)
    assert_close(torch.cat([jac[0]["b"][0].reshape(8, 4), jac[1]["b"][0].reshape(4, 4)]), rows_b)
    one = mixedad.mixed_jacobian(lambda y, g: (y["a"] * g ** 2).sum(), lambda a: torch.tanh(a @ W), z[0], {"a": y["a"]})
    assert set(one) == {"a"} and one["a"].shape == (2, 4, 2, 4)


def test_mixed_jacobian_bad_input():
    G, z, y = problem()
    with pytest.raises(TypeError, match=r"mixed_jacobian\(f, G, z, y\): expected y\['y'\] to be a tensor, got str"):
        mixedad.mixed_jacobian(cubic, G, z, {"y": "text"})
    with pytest.raises(ValueError, match=r"mixed_jacobian\(f, G, z, y\): expected chunk_size .* got -1"):
        mixedad.mixed_jacobian(cubic, G, z, y, chunk_size=-1)


def test_mixed_jacobian_with_dropout_on_a_non_contiguous_tensor():
    """vmap need not draw dropout masks in a plain call's order: a random G takes one pass per row."""
    lin = torch.nn.Linear(3, 3, dtype=torch.float64)

    def G(z):
        return torch.nn.functional.dropout(lin(z.transpose(0, 1)).transpose(0, 1), 0.25) ** 2

    f = lambda y, g: ((y + g) ** 3).sum()  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    z, y = (torch.randn(3, 4, dtype=torch.float64, generator=gen) for _ in range(2))
    torch.manual_seed(1)
    ours = mixedad.mixed_jacobian(f, G, z, y, chunk_size=5)
    after = torch.get_rng_state()
    torch.manual_seed(1)
    expected = double_backward_mixed_jacobian(f, G, z, y)
    assert_close(ours, expected, rtol=1e-10)
    torch.manual_seed(1)
    G(z)
    assert torch.equal(after, torch.get_rng_state())  # as one plain forward leaves it


UNTRUSTED_UNDER_VMAP = {
    # PyTorch's formula is silently wrong here (pytorch#196705): logits 30 apart.
    "logcumsumexp": lambda z: torch.logcumsumexp(z + torch.tensor([0.0, 30.0, 0.0, 0.0], dtype=F64), 0),
    # PyTorch's formula drops the tangent of scatter_reduce(prod).
    "scatter_reduce_prod": lambda z: torch.zeros(2, dtype=F64).scatter_reduce(0, torch.tensor([0, 1, 0, 1]), z, "prod"),
}


@pytest.mark.parametrize("name", sorted(UNTRUSTED_UNDER_VMAP))
def test_mixed_jacobian_does_not_trust_a_silently_wrong_formula_under_vmap(name):
    """The rules step aside under vmap; an op whose PyTorch formula is wrong sends the Jacobian to one pass per row."""
    G = UNTRUSTED_UNDER_VMAP[name]
    gen = torch.Generator().manual_seed(3)
    z, y = torch.randn(4, generator=gen, dtype=F64), torch.randn(G(torch.zeros(4, dtype=F64)).shape, generator=gen, dtype=F64)
    f = lambda y, g: ((y + g) ** 3).sum()  # noqa: E731
    assert_close(mixedad.mixed_jacobian(f, G, z, y), double_backward_mixed_jacobian(f, G, z, y))


def test_vmap_over_tangents_takes_the_local_rule_for_a_silently_wrong_formula():
    G = UNTRUSTED_UNDER_VMAP["logcumsumexp"]
    z, y = torch.randn(4, dtype=F64), torch.randn(4, dtype=F64)
    f = lambda y, g: ((y + g) ** 3).sum()  # noqa: E731
    ours = torch.func.vmap(lambda v: mixedad.mixed_grad(f, G, z, y, v))(torch.eye(4, dtype=F64))
    assert_close(ours, double_backward_mixed_jacobian(f, G, z, y))


def test_vmap_over_codes_refuses_a_silently_wrong_formula_by_name():
    """A vmap that batches z too runs on torch.func's formulas, and this one is wrong: refused by name."""
    G = UNTRUSTED_UNDER_VMAP["logcumsumexp"]
    z, y = torch.randn(4, dtype=F64), torch.randn(4, dtype=F64)
    f = lambda y, g: ((y + g) ** 3).sum()  # noqa: E731
    with pytest.raises(mixedad.op_rules.UnderTransformError, match=r"torch.logcumsumexp is wrong \(pytorch#196705"):
        torch.func.vmap(lambda z_, v: mixedad.mixed_grad(f, G, z_, y, v))(z.expand(4, 4), torch.eye(4, dtype=F64))


def test_mixed_jacobian_uses_a_users_rule():
    calls = []

    @mixedad.op_rules.register(torch.erf, arguments=("input",))
    def erf_tangent(op):
        calls.append(1)
        x = op.primals["input"]
        return op.primal(), op.tangents["input"] * 2 / torch.pi ** 0.5 * torch.exp(-x * x)

    try:
        G = lambda z: torch.erf(z * 1.5)  # noqa: E731
        z, y = torch.randn(3, dtype=F64), torch.randn(3, dtype=F64)
        f = lambda y, g: ((y + g) ** 3).sum()  # noqa: E731
        assert_close(mixedad.mixed_jacobian(f, G, z, y), double_backward_mixed_jacobian(f, G, z, y))
        assert calls  # the rule pushed the rows (all of them in one batched pass)
    finally:
        mixedad.op_rules.unregister(torch.erf)
