"""mixedad.implicit_grad and implicit_argmin: closed forms, finite differences of re-solved minimisers, solvers."""
import warnings

import pytest
import torch

import mixedad
from mixedad.profiling import peak_memory
from mixedad.testing import assert_close

from tests.curvature_problems import F64, problem

GEN = torch.Generator().manual_seed(0)
A = torch.randn(4, 3, generator=GEN, dtype=F64)
B = torch.randn(5, 4, generator=GEN, dtype=F64)


def linear_problem(alpha=0.3):
    """G(z) = A z, f = 1/2 |B g - y|^2 + alpha/2 |z|^2 (G returns (g, z)): z* in closed form."""
    G = lambda z: (z @ A.T, z)  # noqa: E731

    def f(y, g):
        image, z = g
        return 0.5 * ((image @ B.T - y) ** 2).sum() + 0.5 * alpha * (z ** 2).sum()

    M = A.T @ B.T @ B @ A + alpha * torch.eye(3, dtype=F64)
    y = torch.randn(2, 5, generator=GEN, dtype=F64)
    z_star = torch.linalg.solve(M, (y @ B @ A).T).T
    return f, G, z_star, y, M


def test_closed_form_for_a_linear_g_and_a_quadratic_f():
    f, G, z_star, y, M = linear_problem()
    w = torch.randn(2, 3, generator=GEN, dtype=F64)
    # z* = M^-1 A^T B^T y (per row), so d<w, z*>/dy = B A M^-1 w
    expected = w @ torch.linalg.inv(M).T @ A.T @ B.T
    for kind in ("hessian", "ggn"):  # G is linear: the GGN is the Hessian
        assert_close(mixedad.implicit_grad(f, G, z_star, y, w, kind=kind, tol=1e-12), expected, rtol=1e-9)


def test_damping_gives_the_damped_problems_derivative():
    f, G, z_star, y, M = linear_problem()
    w = torch.randn(2, 3, generator=GEN, dtype=F64)
    damped = w @ torch.linalg.inv(M + 0.5 * torch.eye(3, dtype=F64)).T @ A.T @ B.T
    assert_close(mixedad.implicit_grad(f, G, z_star, y, w, damping=0.5, tol=1e-12), damped, rtol=1e-9)


def _nonlinear():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = mixedad.zoo.mlp(2, 3, dtype=F64)
    G = lambda z: (net(z), z)  # noqa: E731
    C = torch.randn(3, 3, generator=torch.Generator().manual_seed(2), dtype=F64)

    def f(y, g):
        image, z = g
        return ((image @ C.T - y["obs"]) ** 2).sum() + y["alpha"] * (z ** 2).sum()

    return f, G


def _argmin(f, G, y):
    z = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    optimiser = torch.optim.LBFGS([z], lr=1, max_iter=500, tolerance_grad=1e-14, tolerance_change=1e-16,
                                  line_search_fn="strong_wolfe")

    def closure():
        optimiser.zero_grad()
        loss = f(y, G(z))
        loss.backward()
        return loss

    for _ in range(4):
        optimiser.step(closure)
    z = z.detach()
    for _ in range(4):  # Newton steps to round-off, so that differences of minimisers are clean
        loss = lambda q: f(y, G(q))  # noqa: E731
        gradient = torch.autograd.functional.jacobian(loss, z).reshape(-1)
        hessian = torch.autograd.functional.hessian(loss, z).reshape(3, 3)
        z = z - torch.linalg.solve(hessian, gradient).reshape(z.shape)
    return z


def test_against_finite_differences_of_re_solved_minimisers():
    """A nonlinear G with a prior, y a dict: d<w, z*>/dy by central differences of z*(y +- eps e)."""
    f, G = _nonlinear()
    y = {"obs": torch.randn(1, 3, generator=torch.Generator().manual_seed(3), dtype=F64),
         "alpha": torch.tensor(0.3, dtype=F64)}
    z_star, w, eps = _argmin(f, G, y), torch.tensor([[0.7, -1.2, 0.4]], dtype=F64), 1e-4
    ours = mixedad.implicit_grad(f, G, z_star, y, w, tol=1e-12)

    def shifted(key, index, step):
        moved = {k: v.clone() for k, v in y.items()}
        moved[key].view(-1)[index] += step
        return (_argmin(f, G, moved) * w).sum()

    expected_obs = torch.tensor([[(shifted("obs", i, eps) - shifted("obs", i, -eps)) / (2 * eps) for i in range(3)]],
                                dtype=F64)
    expected_alpha = (shifted("alpha", 0, eps) - shifted("alpha", 0, -eps)) / (2 * eps)
    assert_close(ours["obs"], expected_obs, rtol=1e-6)
    assert_close(ours["alpha"], expected_alpha, rtol=1e-6)


def test_implicit_argmin_reaches_y_through_backward():
    f, G = _nonlinear()
    theta = torch.tensor([0.1, -0.4, 0.2], dtype=F64, requires_grad=True)
    y = {"obs": (theta * 2).reshape(1, 3), "alpha": torch.tensor(0.3, dtype=F64)}
    z_star = _argmin(f, G, {k: v.detach() for k, v in y.items()})
    z = mixedad.implicit_argmin(f, G, z_star, y, tol=1e-12)
    assert torch.equal(z, z_star) and z.requires_grad
    w = torch.tensor([[1.0, 2.0, -1.0]], dtype=F64)
    (z * w).sum().backward()
    direct = mixedad.implicit_grad(f, G, z_star, {k: v.detach() for k, v in y.items()}, w, tol=1e-12)
    assert_close(theta.grad, 2 * direct["obs"].reshape(3), rtol=1e-12)


def test_the_users_solver_is_honoured():
    f, G, z_star, y, M = linear_problem()
    w = torch.randn(2, 3, generator=GEN, dtype=F64)
    seen = []

    def solve(matvec, b):
        seen.append(b)
        dense = torch.stack([matvec(e.reshape(2, 3)).reshape(-1) for e in torch.eye(6, dtype=F64)], dim=1)
        return torch.linalg.solve(dense, b.reshape(-1)).reshape(2, 3)

    ours = mixedad.implicit_grad(f, G, z_star, y, w, solve=solve, tol=1.0, maxiter=1)  # tol, maxiter unused
    assert len(seen) == 1 and torch.equal(seen[0], w)
    assert_close(ours, w @ torch.linalg.inv(M).T @ A.T @ B.T, rtol=1e-10)
    with pytest.raises(TypeError, match="z's structure"):
        mixedad.implicit_grad(f, G, z_star, y, w, solve=lambda matvec, b: "x")


def test_a_point_that_is_not_stationary_warns():
    f, G, z_star, y, _ = linear_problem()
    w = torch.ones(2, 3, dtype=F64)
    with pytest.warns(RuntimeWarning, match="not a stationary point"):
        mixedad.implicit_grad(f, G, z_star + 0.1, y, w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixedad.implicit_grad(f, G, z_star, y, w)  # no warning at z*


@pytest.mark.parametrize("name", ["batchnorm_eval", "tuple_z"])
def test_batchnorm_eval_and_tuple_z_against_a_dense_solve(name):
    """Not at a minimum (so the stationarity warning is expected): the formula's two factors, checked."""
    from tests.curvature_problems import reference_hessian
    from tests.test_curvature import flat, like_z

    f, G, z, y = problem(name)
    damping = 5.0  # a positive definite damped Hessian
    w = like_z(z)
    with pytest.warns(RuntimeWarning, match="stationary"):
        ours = mixedad.implicit_grad(f, G, z, y, w, damping=damping, tol=1e-12)
    H = reference_hessian(f, G, z, y) + damping * torch.eye(flat(z).numel(), dtype=F64)
    x_flat = torch.linalg.solve(H, flat(w))
    x, offset = [], 0
    for t in (z if isinstance(z, tuple) else (z,)):
        x.append(x_flat[offset:offset + t.numel()].reshape(t.shape))
        offset += t.numel()
    x = tuple(x) if isinstance(z, tuple) else x[0]
    assert_close(ours, -mixedad.reference.double_backward_mixed_grad(f, G, z, y, x), rtol=1e-9)


def _benchmark():
    """benchmarks/curvature_vs_depth.py: its fixed-iteration CG and its torchopt-style anchor."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "curvature_vs_depth.py"
    spec = importlib.util.spec_from_file_location("curvature_vs_depth", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_solve_peak_against_the_anchor():
    """Exact bytes, float32 MLP of width 64 at depth 32, five CG iterations on both sides (damping 1)."""
    from tests.test_curvature import _mlp_problem

    bench = _benchmark()
    _, G, z, y, w = _mlp_problem(32)
    _, anchor = peak_memory(lambda: bench.Anchor(G, z, y).implicit(w))
    _, hessian = peak_memory(bench.ours_solve, G, z, y, w, "hessian")
    _, ggn = peak_memory(bench.ours_solve, G, z, y, w, "ggn")
    assert hessian <= 0.40 * anchor, (hessian, anchor)
    assert ggn <= 0.25 * anchor, (ggn, anchor)


# -- found by a review as a new user --------------------------------------------------------------------

def test_a_solver_returning_none_is_refused():
    f, G, z_star, y, _ = linear_problem()
    with pytest.raises(TypeError, match="returned None"):
        mixedad.implicit_grad(f, G, z_star, y, torch.ones_like(z_star), solve=lambda matvec, b: None)


def test_implicit_argmin_refuses_create_graph_instead_of_dropping_second_order_terms():
    f, G, z_star, y, _ = linear_problem()
    y = y.clone().requires_grad_()
    out = mixedad.implicit_argmin(f, G, z_star, y)
    with pytest.raises(RuntimeError, match="differentiated once"):
        torch.autograd.grad(out.sum(), y, create_graph=True)


def test_implicit_argmin_checks_its_arguments_at_the_call():
    f, G, z_star, y, _ = linear_problem()
    for keywords, error in (({"damping": -1}, ValueError), ({"tol": 0}, ValueError), ({"maxiter": 0}, ValueError),
                            ({"solve": 3}, TypeError), ({"segments": None}, TypeError), ({"keep_graph": 1}, TypeError)):
        with pytest.raises(error):
            mixedad.implicit_argmin(f, G, z_star, y.clone().requires_grad_(), **keywords)


def test_an_exact_minimiser_does_not_warn_and_the_warning_points_at_the_callers_line():
    A = torch.tensor([[2.0, 1.0], [1.0, 3.0]], dtype=F64)
    f = lambda y, g: 0.5 * ((g - y) ** 2).sum()  # noqa: E731
    y = torch.tensor([1.0, 2.0], dtype=F64)
    z_star = torch.linalg.solve(A, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixedad.implicit_grad(f, lambda z: A @ z, z_star, y, torch.tensor([1.0, 0.0], dtype=F64))
    with pytest.warns(RuntimeWarning, match="not a stationary point") as record:
        mixedad.implicit_grad(f, lambda z: A @ z, z_star + 0.5, y, torch.tensor([1.0, 0.0], dtype=F64))
    assert record[0].filename == __file__
