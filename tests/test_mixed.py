"""mixed_grad against double backward (mixedad.reference) and finite differences, in float64."""
import pytest
import torch

import mixedad
from mixedad import zoo
from mixedad.reference import (
    double_backward_mixed_grad,
    finite_difference_mixed_directional,
    finite_difference_mixed_grad,
)
from mixedad.testing import assert_close

F64 = torch.float64


def _randn(*shape, seed, device="cpu", dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=dtype).to(device)


def cubic(y, g):
    return ((y + g) ** 3).sum() + (torch.sin(y) * g).sum()


# Each case builds (f, G, z, y, v) on a device and dtype. v=None exercises the default.
def case_mlp(device, dtype):
    G = zoo.mlp(4, 16, seed=1, dtype=dtype, device=device)
    return cubic, G, _randn(5, 16, seed=2, device=device, dtype=dtype), _randn(5, 16, seed=3, device=device, dtype=dtype), _randn(5, 16, seed=4, device=device, dtype=dtype)


def case_dcgan(device, dtype):
    G = zoo.dcgan(latent_dim=6, channels=4, image_size=8, extra_blocks=1, seed=1, dtype=dtype, device=device)
    z = _randn(2, 6, seed=2, device=device, dtype=dtype)
    y = _randn(2, 3, 8, 8, seed=3, device=device, dtype=dtype)
    return cubic, G, z, y, _randn(2, 6, seed=4, device=device, dtype=dtype)


def seed_G(x):
    return x.sum(dim=1).exp()


def seed_f(y, g_out):
    return ((y.sum(dim=1) + g_out) ** 3).sum()


def case_seed(device, dtype):
    """The forum thread's own example (seeds/003), with its default v = ones."""
    return seed_f, seed_G, torch.rand(3, 4, dtype=dtype, generator=torch.Generator().manual_seed(0)).to(device), \
        torch.rand(3, 4, dtype=dtype, generator=torch.Generator().manual_seed(1)).to(device), None


def case_pytree_y(device, dtype):
    """y is a dict holding a learned matrix, a bias and a tuple of scales, all used by f."""
    G = zoo.mlp(3, 8, seed=5, dtype=dtype, device=device)
    y = {
        "A": _randn(8, 4, seed=6, device=device, dtype=dtype),
        "b": _randn(4, seed=7, device=device, dtype=dtype),
        "scales": (_randn(1, seed=8, device=device, dtype=dtype), _randn(3, 1, seed=9, device=device, dtype=dtype)),
    }

    def f(y, g):
        h = torch.tanh(g @ y["A"] + y["b"]) * y["scales"][0]
        return (h ** 2 * y["scales"][1]).sum()

    return f, G, _randn(3, 8, seed=10, device=device, dtype=dtype), y, _randn(3, 8, seed=11, device=device, dtype=dtype)


def case_default_v(device, dtype):
    f, G, z, y, _ = case_mlp(device, dtype)
    return f, G, z, y, None


def case_batch_middle(device, dtype):
    """Batch dimensions before and after the feature dimension G acts on."""
    mlp = zoo.mlp(3, 6, seed=12, dtype=dtype, device=device)

    def G(z):  # z: (2, 6, 3): features in the middle
        return mlp(z.transpose(1, 2)).transpose(1, 2)

    z = _randn(2, 6, 3, seed=13, device=device, dtype=dtype)
    return cubic, G, z, _randn(2, 6, 3, seed=14, device=device, dtype=dtype), _randn(2, 6, 3, seed=15, device=device, dtype=dtype)


def case_broadcast_y(device, dtype):
    """y smaller than g: f broadcasts it over the batch (a shared target)."""
    G = zoo.mlp(3, 8, seed=16, dtype=dtype, device=device)
    z = _randn(4, 3, 8, seed=17, device=device, dtype=dtype)  # two batch dims
    return cubic, G, z, _randn(8, seed=18, device=device, dtype=dtype), _randn(4, 3, 8, seed=19, device=device, dtype=dtype)


CASES = {
    "mlp": case_mlp,
    "dcgan": case_dcgan,
    "seed": case_seed,
    "pytree_y": case_pytree_y,
    "default_v": case_default_v,
    "batch_middle": case_batch_middle,
    "broadcast_y": case_broadcast_y,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_double_backward_float64(name, device):
    f, G, z, y, v = CASES[name](device, F64)
    expected = double_backward_mixed_grad(f, G, z, y, v)
    actual = mixedad.mixed_grad(f, G, z, y, v)
    assert_close(actual, expected, rtol=1e-9, what=f"mixed_grad on {name}")
    # The comparison means something only if the answer is not trivially zero.
    assert max(leaf.abs().max().item() for leaf in torch.utils._pytree.tree_leaves(expected)) > 1e-3


@pytest.mark.parametrize("name", ["mlp", "dcgan", "seed"])
def test_matches_double_backward_float32(name, device):
    f, G, z, y, v = CASES[name](device, torch.float32)
    assert_close(mixedad.mixed_grad(f, G, z, y, v), double_backward_mixed_grad(f, G, z, y, v), rtol=1e-4)


def test_seed_example_allclose():
    """The exact snippet from the forum thread: torch.allclose(...) is True."""
    z = torch.rand((3, 4))
    y = torch.rand((3, 4), requires_grad=True)
    expected = double_backward_mixed_grad(seed_f, seed_G, z, y)
    assert torch.allclose(mixedad.mixed_grad(seed_f, seed_G, z, y), expected)


@pytest.mark.parametrize("name", ["mlp", "seed", "pytree_y", "batch_middle"])
def test_matches_finite_differences(name):
    f, G, z, y, v = CASES[name]("cpu", F64)
    actual = mixedad.mixed_grad(f, G, z, y, v)
    assert_close(actual, finite_difference_mixed_grad(f, G, z, y, v, eps=1e-4), rtol=1e-6,
                 what=f"mixed_grad vs finite differences on {name}")


def test_reference_matches_finite_differences():
    """The ground truth is itself checked against an autograd-free answer."""
    f, G, z, y, v = CASES["dcgan"]("cpu", F64)
    y = y[:, :, :2, :2].contiguous()  # keep the finite differences cheap

    def f_small(y_small, g):
        return cubic(y_small, g[:, :, :2, :2]) + (g ** 2).sum()

    assert_close(double_backward_mixed_grad(f_small, G, z, y, v),
                 finite_difference_mixed_grad(f_small, G, z, y, v), rtol=1e-6)


def test_create_graph_differentiable_in_y():
    """create_graph=True: d/dy of <w, mixed_grad> equals the reference's third derivative."""
    f, G, z, y, v = CASES["pytree_y"]("cpu", F64)
    y = {k: (val.requires_grad_() if isinstance(val, torch.Tensor) else tuple(t.requires_grad_() for t in val))
         for k, val in y.items()}
    leaves = torch.utils._pytree.tree_leaves(y)
    weights = [torch.randn_like(leaf) for leaf in leaves]

    def scalar(result):
        return sum((w * r).sum() for w, r in zip(weights, torch.utils._pytree.tree_leaves(result)))

    ours = torch.autograd.grad(scalar(mixedad.mixed_grad(f, G, z, y, v, create_graph=True)), leaves)
    ref = torch.autograd.grad(scalar(double_backward_mixed_grad(f, G, z, y, v, create_graph=True)), leaves)
    assert_close(list(ours), list(ref), rtol=1e-9)
    assert max(t.abs().max().item() for t in ref) > 1e-3


def test_without_create_graph_result_has_no_graph():
    f, G, z, y, v = CASES["mlp"]("cpu", F64)
    result = mixedad.mixed_grad(f, G, z, y.requires_grad_(), v)
    assert result.grad_fn is None and not result.requires_grad


def test_inside_no_grad_still_correct():
    """A call under torch.no_grad() must not silently return zeros."""
    f, G, z, y, v = CASES["mlp"]("cpu", F64)
    expected = double_backward_mixed_grad(f, G, z, y, v)
    with torch.no_grad():
        actual = mixedad.mixed_grad(f, G, z, y, v)
    assert_close(actual, expected)


def test_unused_y_leaf_gets_zeros():
    f, G, z, y, v = CASES["mlp"]("cpu", F64)
    unused = torch.randn(7, dtype=F64)
    additive = torch.randn(5, 16, dtype=F64)  # enters f separately from g: zero mixed partial

    def f2(ys, g):
        return f(ys[0], g) + (ys[2] ** 2).sum()

    result = mixedad.mixed_grad(f2, G, z, [y, unused, additive], v)
    expected = double_backward_mixed_grad(f2, G, z, [y, unused, additive], v)
    assert_close(result, expected)
    assert torch.equal(result[1], torch.zeros(7, dtype=F64))
    assert torch.equal(result[2], torch.zeros(5, 16, dtype=F64))
    assert result[0].abs().max() > 0


def test_f_without_mixed_term_gives_zeros():
    """f = a(y) + b(g) has no mixed partial; the answer is exactly zero, not an error."""
    f, G, z, y, v = CASES["mlp"]("cpu", F64)
    result = mixedad.mixed_grad(lambda y, g: (y ** 2).sum() + g.sum(), G, z, y, v)
    assert torch.equal(result, torch.zeros_like(y))


def test_G_output_pytree():
    """G may return a tuple or dict; f receives the same structure."""
    mlp = zoo.mlp(3, 8, seed=20, dtype=F64)

    def G(z):
        h = mlp(z)
        return {"image": h, "aux": (h.sum(-1), torch.tanh(z))}

    def f(y, g):
        return ((y + g["image"]) ** 3).sum() + (y.sum(-1) * g["aux"][0] ** 2).sum() + (y * g["aux"][1]).sum()

    z, y, v = (torch.randn(4, 8, dtype=F64) for _ in range(3))
    assert_close(mixedad.mixed_grad(f, G, z, y, v), double_backward_mixed_grad(f, G, z, y, v))


def test_matches_directional_finite_difference_on_a_deep_generator():
    """One autograd-free second difference checks a case too big for entrywise differences."""
    G = zoo.mlp(32, 64, seed=21, dtype=F64)
    z, y, v, w = (_randn(16, 64, seed=s) for s in (22, 23, 24, 25))
    result = mixedad.mixed_grad(cubic, G, z, y, v)
    fd = finite_difference_mixed_directional(cubic, G, z, y, v, w=w)
    assert abs((w * result).sum().item() - fd) <= 1e-5 * abs(fd)


def test_directional_finite_difference_checks_w():
    f, G, z, y, v = CASES["pytree_y"]("cpu", F64)
    with pytest.raises(ValueError, match=r"finite_difference_mixed_directional\(f, G, z, y\): expected w to have y's structure"):
        finite_difference_mixed_directional(f, G, z, y, v, w=[y["A"]])
    bad = dict(y, b=torch.zeros(5, dtype=F64))
    with pytest.raises(ValueError, match=r"w\['b'\] must have y\['b'\]'s shape \(4,\), got \(5,\)"):
        finite_difference_mixed_directional(f, G, z, y, v, w=bad)
