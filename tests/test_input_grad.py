"""input_grad against the naive create_graph code, in float64."""
import pytest
import torch

import mixedad
from mixedad import zoo
from mixedad.reference import double_backward_input_grad
from mixedad.testing import assert_close

F64 = torch.float64


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def measurement_objective(y, g):
    """A learned measurement matrix A and bias b; g is a batch of generated signals."""
    return ((torch.tanh(g @ y["A"] + y["b"]) - y["target"]) ** 2).sum() + (g ** 2 * y["b"].sum()).sum()


def outer(dfdz, x):
    """A nonlinear g(dfdz_1..N, x) that couples all codes and uses x."""
    return torch.log1p((dfdz @ x) ** 2).sum() + (dfdz.sum(0) * x.sum(1)).pow(2).sum()


def problem(n=7, depth=4, width=8):
    G = zoo.mlp(depth, width, seed=1, dtype=F64)
    z = _randn(n, width, seed=2)
    y = {"A": _randn(width, 5, seed=3), "b": _randn(5, seed=4), "target": _randn(5, seed=5)}
    x = _randn(width, 3, seed=6)
    return G, z, y, x


def leaves_requiring_grad(y, x):
    y = {k: v.clone().requires_grad_() for k, v in y.items()}
    return y, x.clone().requires_grad_()


def pipeline(make_dfdz, G, z, y, x):
    y, x = leaves_requiring_grad(y, x)
    dfdz = make_dfdz(measurement_objective, G, z, y)
    outer(dfdz, x).backward()
    return dfdz.detach(), {k: v.grad for k, v in y.items()}, x.grad


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 7, 100])
def test_seed_pipeline_matches_naive_create_graph(chunk_size):
    G, z, y, x = problem()
    ours = pipeline(lambda *a: mixedad.input_grad(*a, chunk_size=chunk_size), G, z, y, x)
    naive = pipeline(lambda *a: double_backward_input_grad(*a, chunk_size=chunk_size), G, z, y, x)
    for name, a, b in zip(["dfdz", "y.grad", "x.grad"], ours, naive):
        assert_close(a, b, rtol=1e-9, what=f"{name} (chunk_size={chunk_size})")
    assert ours[1]["A"].abs().max() > 1e-3 and ours[2].abs().max() > 1e-3


def test_chunked_sum_equals_unchunked_when_f_sums_over_the_batch():
    G, z, y, x = problem()
    a = pipeline(lambda *args: mixedad.input_grad(*args, chunk_size=2), G, z, y, x)
    b = pipeline(lambda *args: mixedad.input_grad(*args), G, z, y, x)
    assert_close(a, b, rtol=1e-9)


def test_per_code_loop_as_in_the_forum_thread():
    """dfdz_i = input_grad(f, G, z_i, y) for each code, then g over the list."""
    G, z, y, x = problem(n=4)
    y1, x1 = leaves_requiring_grad(y, x)
    outer(torch.stack([mixedad.input_grad(measurement_objective, G, z[i:i + 1], y1)[0] for i in range(4)]), x1).backward()
    y2, x2 = leaves_requiring_grad(y, x)
    outer(torch.stack([double_backward_input_grad(measurement_objective, G, z[i:i + 1], y2)[0] for i in range(4)]), x2).backward()
    assert_close([v.grad for v in y1.values()] + [x1.grad], [v.grad for v in y2.values()] + [x2.grad])


def test_dcgan_images():
    G = zoo.dcgan(latent_dim=6, channels=4, image_size=8, extra_blocks=1, seed=2, dtype=F64)
    z = _randn(5, 6, seed=7)
    target = _randn(3, 8, 8, seed=8)

    def f(y, g):
        return ((g * y - target) ** 2).sum()

    def run(make):
        y = _randn(3, 8, 8, seed=9).requires_grad_()
        x = _randn(6, seed=10).requires_grad_()
        (torch.sin(make(f, G, z, y) @ x) ** 2).sum().backward()
        return y.grad, x.grad

    assert_close(run(lambda *a: mixedad.input_grad(*a, chunk_size=2)), run(double_backward_input_grad))


def test_only_leaves_that_require_grad_get_gradients():
    G, z, y, x = problem()
    y = dict(y, A=y["A"].clone().requires_grad_())
    outer(mixedad.input_grad(measurement_objective, G, z, y), x).backward()
    assert y["A"].grad is not None and y["b"].grad is None and y["target"].grad is None


def test_generator_untouched():
    G, z, y, x = problem()
    flags = [p.requires_grad for p in G.parameters()]
    y, x = leaves_requiring_grad(y, x)
    outer(mixedad.input_grad(measurement_objective, G, z, y, chunk_size=3), x).backward()
    assert [p.requires_grad for p in G.parameters()] == flags
    assert all(p.grad is None for p in G.parameters())
    assert not G.training


def test_no_graph_through_G_outlives_forward():
    """What the result keeps alive after the forward call does not grow with G's depth."""
    from mixedad.profiling import StorageCounter

    def retained(depth, make):
        G, z, y, x = problem(n=16, depth=depth, width=32)
        y, x = leaves_requiring_grad(y, x)
        with StorageCounter() as counter:
            dfdz = make(measurement_objective, G, z, y)
            alive = counter.current
        del dfdz
        return alive

    ours = [retained(d, lambda *a: mixedad.input_grad(*a, chunk_size=4)) for d in (2, 16)]
    naive = [retained(d, lambda *a: double_backward_input_grad(*a, chunk_size=4)) for d in (2, 16)]
    assert ours[0] == ours[1]
    assert naive[1] > 3 * naive[0]


def test_z_requiring_grad_is_refused():
    G, z, y, _ = problem()
    with pytest.raises(ValueError, match=r"input_grad\(f, G, z, y\): z requires grad.*double_backward_input_grad"):
        mixedad.input_grad(measurement_objective, G, z.requires_grad_(), y)


def test_closure_that_requires_grad_is_refused():
    G, z, y, _ = problem()
    hidden = torch.ones(5, dtype=F64, requires_grad=True)
    derived = hidden * 2  # a non-leaf closure leads to the same lost gradient

    for captured in (hidden, derived):
        def f(y, g):
            return measurement_objective(y, g) + (g @ y["A"] * captured).sum()

        with pytest.raises(ValueError, match=r"f reads a torch.float64 tensor of shape \(5,\) .* not part of y"):
            mixedad.input_grad(f, G, z, y)


def test_constant_closure_is_fine():
    G, z, y, x = problem()
    constant = torch.ones(5, dtype=F64)
    f = lambda y, g: measurement_objective(y, g) * constant.sum()  # noqa: E731
    y1, x1 = leaves_requiring_grad(y, x)
    outer(mixedad.input_grad(f, G, z, y1), x1).backward()
    y2, x2 = leaves_requiring_grad(y, x)
    outer(double_backward_input_grad(f, G, z, y2), x2).backward()
    assert_close([v.grad for v in y1.values()], [v.grad for v in y2.values()])


def test_second_differentiation_raises_instead_of_being_wrong():
    G, z, y, x = problem()
    y, x = leaves_requiring_grad(y, x)
    t = outer(mixedad.input_grad(measurement_objective, G, z, y), x)
    (grad_a,) = torch.autograd.grad(t, y["A"], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_a.sum().backward()


@pytest.mark.parametrize("chunk_size, exc", [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_chunk_size(chunk_size, exc):
    G, z, y, _ = problem()
    pattern = rf"input_grad\(f, G, z, y\): expected chunk_size to be None or a positive int, got {chunk_size!r}\."
    with pytest.raises(exc, match=pattern):
        mixedad.input_grad(measurement_objective, G, z, y, chunk_size=chunk_size)


def test_chunks_need_a_leading_dimension():
    with pytest.raises(ValueError, match="0-d z"):
        mixedad.input_grad(lambda y, g: (y * g).sum(), torch.sin, torch.tensor(1.0, dtype=F64),
                           torch.ones((), dtype=F64), chunk_size=1)


def test_generator_returning_a_pytree():
    mlp = zoo.mlp(3, 8, seed=11, dtype=F64)
    G = lambda z: {"image": mlp(z), "code": (torch.tanh(z),)}  # noqa: E731

    def f(y, g):
        return measurement_objective(y, g["image"]) + (g["code"][0] @ y["A"] * y["b"]).pow(2).sum()

    _, z, y, x = problem()
    a = pipeline(lambda _, *args: mixedad.input_grad(f, *args, chunk_size=3), G, z, y, x)
    b = pipeline(lambda _, *args: double_backward_input_grad(f, *args, chunk_size=3), G, z, y, x)
    assert_close(a, b)
    assert a[1]["A"].abs().max() > 1e-3


def test_seed_pipeline_on_each_device(device):
    G, z, y, x = problem()
    G, z, x = G.to(device), z.to(device), x.to(device)
    y = {k: v.to(device) for k, v in y.items()}
    ours = pipeline(lambda *a: mixedad.input_grad(*a, chunk_size=2), G, z, y, x)
    naive = pipeline(double_backward_input_grad, G, z, y, x)
    assert ours[2].device.type == device
    assert_close(ours, naive)
