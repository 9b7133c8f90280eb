r"""Conjugate gradients on tensors with z's structure (lists of tensors).

.. math::

    A x = b, \qquad \lVert b - A x_k \rVert \le \mathrm{tol}\cdot\lVert b\rVert

A must be symmetric positive definite. A search direction p with :math:`p^\top A p \le 0` shows
that it is not (an indefinite Hessian away from a minimum): CG then breaks down, and this says so
instead of returning a meaningless x. Inner products are accumulated in float64.
"""
import warnings

import torch

__all__ = ["CurvatureError", "conjugate_gradient"]


class CurvatureError(RuntimeError):
    r"""A solve that cannot go on: the operator is not positive definite along a search direction p.

    .. math::

        p^\top (H + \lambda I)\, p \le 0

    Example:
        >>> import torch, mixedad
        >>> op = mixedad.z_curvature(lambda y, g: -(g ** 2).sum(), torch.nn.Identity(), torch.ones(2), torch.ones(2),
        ...                          kind="hessian")
        >>> try:
        ...     op.solve(torch.ones(2))
        ... except mixedad.CurvatureError:
        ...     print("indefinite")
        indefinite
    """


def _dot(a, b):
    return sum(float(torch.sum(x.double() * y.double())) for x, y in zip(a, b))


def conjugate_gradient(call, matvec, b, *, tol=1e-6, maxiter=None):
    """``(x, iterations, relative residual)`` for ``matvec(x) = b``; ``b`` and ``x`` are lists of tensors.

    Warns (RuntimeWarning) when ``maxiter`` iterations (default: the dimension of b) end above
    the tolerance, and raises :class:`CurvatureError` when the operator shows a direction of
    non-positive curvature.
    """
    if not tol > 0:
        raise ValueError(f"{call}: expected tol > 0, got {tol}.")
    size = sum(t.numel() for t in b)
    maxiter = size if maxiter is None else maxiter
    if isinstance(maxiter, bool) or not isinstance(maxiter, int) or maxiter < 1:
        raise ValueError(f"{call}: expected maxiter to be a positive int or None, got {maxiter!r}.")
    x = [torch.zeros_like(t) for t in b]
    b_norm = _dot(b, b) ** 0.5
    if b_norm == 0:
        return x, 0, 0.0
    r = [t.clone() for t in b]
    p = [t.clone() for t in b]
    rr = _dot(r, r)
    for iteration in range(1, maxiter + 1):
        ap = matvec(p)
        curvature = _dot(p, ap)
        if not curvature > 0:
            raise CurvatureError(
                f"{call}: conjugate gradients broke down at iteration {iteration}: p^T (H + damping I) p = "
                f"{curvature:.3g} along a search direction, so the operator is not positive definite (a Hessian away "
                f"from a minimum, or at a saddle). Add damping, use kind='ggn' (positive semi-definite for a convex "
                f"f), or pass your own solve=.")
        alpha = rr / curvature
        x = [xi + alpha * pi for xi, pi in zip(x, p)]
        r = [ri - alpha * api for ri, api in zip(r, ap)]
        rr_next = _dot(r, r)
        if rr_next ** 0.5 <= tol * b_norm:
            return x, iteration, rr_next ** 0.5 / b_norm
        p = [ri + (rr_next / rr) * pi for ri, pi in zip(r, p)]
        rr = rr_next
    residual = rr ** 0.5 / b_norm
    warnings.warn(f"{call}: conjugate gradients reached maxiter={maxiter} with relative residual {residual:.3g} > "
                  f"tol={tol:g}; the solution is approximate. Raise maxiter, add damping, or loosen tol.",
                  RuntimeWarning, stacklevel=3)
    return x, maxiter, residual
