"""Conjugate gradients on lists of tensors: convergence, breakdown on indefinite operators, maxiter."""
import pytest
import torch

from mixedad._curvature.cg import CurvatureError, conjugate_gradient

F64 = torch.float64


def _spd(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, n, generator=gen, dtype=F64)
    return q @ q.T + n * torch.eye(n, dtype=F64)


def test_solves_a_split_system_to_the_tolerance():
    A = _spd(7)
    b = [torch.randn(3, dtype=F64), torch.randn(2, 2, dtype=F64)]

    def matvec(p):
        out = A @ torch.cat([t.reshape(-1) for t in p])
        return [out[:3], out[3:].reshape(2, 2)]

    x, iterations, residual = conjugate_gradient("test", matvec, b, tol=1e-12)
    flat_b = torch.cat([t.reshape(-1) for t in b])
    assert (A @ torch.cat([t.reshape(-1) for t in x]) - flat_b).norm() <= 1e-12 * flat_b.norm() * 1.01
    assert iterations <= 7 and residual <= 1e-12 and [t.shape for t in x] == [t.shape for t in b]


def test_zero_right_hand_side_returns_zero_at_once():
    x, iterations, _ = conjugate_gradient("test", lambda p: p, [torch.zeros(3, dtype=F64)])
    assert iterations == 0 and torch.equal(x[0], torch.zeros(3, dtype=F64))


def test_indefinite_operator_raises():
    A = torch.diag(torch.tensor([1.0, -2.0, 3.0], dtype=F64))
    with pytest.raises(CurvatureError, match="not positive definite"):
        conjugate_gradient("test", lambda p: [A @ p[0]], [torch.ones(3, dtype=F64)])


def test_maxiter_warns_with_the_residual():
    A = _spd(20)
    with pytest.warns(RuntimeWarning, match=r"\(maxiter=3\) with relative residual"):
        _, iterations, residual = conjugate_gradient("test", lambda p: [A @ p[0]], [torch.ones(20, dtype=F64)],
                                                     tol=1e-14, maxiter=3)
    assert iterations == 3 and residual > 1e-14


def test_bad_tolerances():
    with pytest.raises(ValueError, match="tol > 0"):
        conjugate_gradient("test", lambda p: p, [torch.ones(2)], tol=0)
    with pytest.raises(ValueError, match="maxiter"):
        conjugate_gradient("test", lambda p: p, [torch.ones(2)], maxiter=0)


def test_a_tolerance_below_what_float32_resolves_still_gives_float32s_answer():
    """A tolerance far below float32's rounding: CG stops (on its recursive residual, or where it stalls, warning)
    and never reports a breakdown of a positive definite operator."""
    import warnings

    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(30, 30, generator=gen, dtype=torch.float64))
    A = (q @ torch.diag(torch.linspace(1, 50, 30, dtype=torch.float64)) @ q.T).float()
    b = torch.randn(30, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        x, _, _ = conjugate_gradient("test", lambda p: [A @ p[0]], [b], tol=1e-12)
    assert float((A.double() @ x[0].double() - b.double()).norm() / b.double().norm()) < 1e-5
