r"""Conjugate gradients on tensors with z's structure (lists of tensors).

.. math::

    A x = b, \qquad \lVert b - A x_k \rVert \le \mathrm{tol}\cdot\lVert b\rVert

A must be symmetric positive definite. A search direction p with :math:`p^\top A p \le 0` shows
that it is not (an indefinite Hessian away from a minimum): CG then breaks down, and this says so
instead of returning a meaningless x. Inner products are accumulated in float64.
"""
import math
import warnings

import torch

from mixedad._entry import user_stacklevel

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


#: Advice for a breakdown, by what the operator is.
ADVICE = {
    "hessian": "a Hessian away from a minimum, or at a saddle: add damping, use kind='ggn' (positive semi-definite "
               "for a convex f), or pass your own solve=",
    "ggn": "the Gauss-Newton matrix is only positive semi-definite, and singular where G's Jacobian has a null space "
           "(more latent dimensions than the output constrains, a compressed-sensing shape): add damping, or pass "
           "your own solve=",
}


def conjugate_gradient(call, matvec, b, *, tol=1e-6, maxiter=None, kind="hessian"):
    """``(x, iterations, relative residual)`` for ``matvec(x) = b``; ``b`` and ``x`` are lists of tensors.

    ``maxiter`` defaults to twice the dimension of b (in exact arithmetic CG ends within the
    dimension; in floating point it may need a few more). Warns (RuntimeWarning) when the
    iterations end above the tolerance, returning the best iterate: maxiter reached, or the
    residual stalled at what the dtype can resolve (a ``tol`` below it cannot be met). Raises
    :class:`CurvatureError` when the operator shows a direction of non-positive curvature, or
    when the default budget ends farther from b than x = 0 (a singular or numerically indefinite
    operator). ``kind`` words the advice.
    """
    if not tol > 0:
        raise ValueError(f"{call}: expected tol > 0, got {tol}.")
    size = sum(t.numel() for t in b)
    budget = maxiter is None  # the whole default budget spent: a residual above |b| is then a breakdown
    maxiter = 2 * size if maxiter is None else maxiter
    if isinstance(maxiter, bool) or not isinstance(maxiter, int) or maxiter < 1:
        raise ValueError(f"{call}: expected maxiter to be a positive int or None, got {maxiter!r}.")
    x = [torch.zeros_like(t) for t in b]
    b_norm = _dot(b, b) ** 0.5
    if not math.isfinite(b_norm):
        raise ValueError(f"{call}: the right-hand side holds NaN or infinite values.")
    if b_norm == 0:
        return x, 0, 0.0
    advice = ADVICE.get(kind, ADVICE["hessian"])
    floor = torch.finfo(b[0].dtype).eps ** 0.5 if b[0].is_floating_point() else 0.0
    r = [t.clone() for t in b]
    p = [t.clone() for t in b]
    rr = _dot(r, r)
    best, best_x, iteration = 1.0, x, 0
    while iteration < maxiter:
        iteration += 1
        ap = matvec(p)
        curvature = _dot(p, ap)
        if not (math.isfinite(curvature) and curvature > 0):
            if best <= floor or not math.isfinite(curvature):
                break  # stalled where rounding dominates: the best iterate, with the warning below
            raise CurvatureError(
                f"{call}: conjugate gradients broke down at iteration {iteration}: p^T (H + damping I) p = "
                f"{curvature:.3g} along a search direction, so the operator is not positive definite ({advice}).")
        alpha = rr / curvature
        x = [xi + alpha * pi for xi, pi in zip(x, p)]
        r = [ri - alpha * api for ri, api in zip(r, ap)]
        rr_next = _dot(r, r)
        residual = rr_next ** 0.5 / b_norm
        if residual <= tol:
            return x, iteration, residual
        if not math.isfinite(rr_next):
            break
        if residual < best:
            best, best_x = residual, x
        p = [ri + (rr_next / rr) * pi for ri, pi in zip(r, p)]
        rr = rr_next
    if budget and not best < 1:
        raise CurvatureError(f"{call}: conjugate gradients ended at relative residual {best:.3g}, no nearer b than "
                             f"x = 0: the operator is singular or numerically indefinite ({advice}).")
    warnings.warn(f"{call}: conjugate gradients stopped after {iteration} iterations (maxiter={maxiter}) with relative "
                  f"residual {best:.3g} > tol={tol:g}; the solution is approximate. Raise maxiter, add damping, or "
                  f"loosen tol (float32 resolves about {torch.finfo(torch.float32).eps ** 0.5:.0e}).",
                  RuntimeWarning, stacklevel=user_stacklevel())
    return best_x, iteration, best
