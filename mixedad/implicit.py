r"""Implicit differentiation through a frozen G: the derivative in y of :math:`z^*(y) = \arg\min_z f(y, G(z))`.

.. math::

    \frac{d\,\langle w, z^*(y)\rangle}{dy}
    = -\Big(\frac{\partial^2 L}{\partial z\,\partial y}\Big)^{\!\top} (H_{zz} + \lambda I)^{-1} w,
    \qquad L = f(y, G(z)),\quad H_{zz} = \nabla^2_z L \text{ at } z^*

The mixed term is :func:`mixedad.mixed_grad` (flat in G's depth); the solve is conjugate
gradients on :func:`mixedad.z_curvature` (or the caller's own solver). For GAN inversion,
compressed sensing and inverse problems with generative priors, learned measurement operators.
"""
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch

from mixedad import _checks
from mixedad._entry import eager, public_call, user_stacklevel
from mixedad._ground.state import Snapshot
from mixedad._ground.reach import modules_reached
from mixedad._ground.versions import Versions, input_labels
from mixedad._hooks.pytree import tree_flatten, tree_unflatten
from mixedad.curvature import ZCurvature, _check_settings
from mixedad.mixed import mixed_grad

__all__ = ["implicit_grad", "implicit_argmin", "STATIONARY_TOLERANCE"]

#: ``implicit_grad`` warns when :math:`\lVert\nabla_z L\rVert` exceeds this fraction of its scale
#: :math:`\sum_k \lVert\nabla_{g_k} f\rVert\,\lVert J_{G_k} u\rVert / \lVert u\rVert` (u random):
#: z* is then visibly not a stationary point, and the formula does not hold.
STATIONARY_TOLERANCE = 1e-2


def _solve(call, op, w, tol, maxiter, solve):
    if solve is None:
        return op.solve(w, tol=tol, maxiter=maxiter)
    _checks.check_callable(call, "solve", solve)
    x = solve(op.matvec, w)
    try:
        if x is None:
            raise TypeError("it returned None")
        op._as_list(x)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{call}: solve(matvec, b) must return x with z's structure ({error})") from error
    return x


def _check_stationary(call, op):
    """Warn when z* is visibly not stationary: :math:`\\lVert\\nabla_z L\\rVert` against its scale."""
    chain = op._chain
    lam = op.f_gradient()
    with op._replaying():
        gradient = chain.gradient(lam)
    norm = sum(float(g.double().pow(2).sum()) for g in gradient) ** 0.5
    if norm == 0:
        return
    generator = torch.Generator(device=op._zs[0].device).manual_seed(0)
    probe = [torch.randn(z.shape, generator=generator, dtype=z.dtype, device=z.device) for z in op._zs]
    probe_norm = sum(float(p.double().pow(2).sum()) for p in probe) ** 0.5
    from mixedad._curvature.segments import push

    with op._replaying():
        outputs, pushed, _ = push(call, op._G, op._zs, [p.unsqueeze(0) for p in probe])
    gains = [float(t[0].double().norm()) / probe_norm if t is not None else 0.0 for t in pushed]
    scale = sum(float(l.double().norm()) * gain for l, gain in zip(lam, gains) if l is not None)
    # At an exact fit the gradient and its scale are both round-off, and their ratio means nothing: below what
    # rounding G's output alone would give, nothing is said.
    eps = torch.finfo(op._zs[0].dtype).eps
    floor = 64 * eps * sum(float(o.double().norm()) * gain for o, gain in zip(outputs, gains)
                           if isinstance(o, torch.Tensor) and o.is_floating_point())
    if norm > STATIONARY_TOLERANCE * scale and norm > floor:
        warnings.warn(f"{call}: z_star is not a stationary point of f(y, G(z)): |grad_z L| = {norm:.3g}, "
                      f"{norm / scale if scale else float('inf'):.3g} of its scale (tolerance "
                      f"{STATIONARY_TOLERANCE:g}). The implicit-function formula holds only at a minimum; optimise "
                      f"z further.", RuntimeWarning, stacklevel=user_stacklevel())


def _implicit(call, f, G, z_star, y, w, kind, damping, tol, maxiter, solve, segments, keep_graph):
    damping = _check_settings(call, kind=kind, damping=damping, keep_graph=keep_graph, tol=tol, maxiter=maxiter,
                              solve=solve)
    if w is None:
        raise TypeError(f"{call}: expected w with z_star's structure (the outer loss's gradient at z*), got None.")
    op = ZCurvature(call, f, G, z_star, y, kind=kind, damping=damping, segments=segments, keep_graph=keep_graph)
    assert op._versions is not None
    name = call.split("(")[0]
    op._versions.after = f"{name} built its curvature operator"
    op._versions.fix = f"Leave G, z_star and y as they are until {name} returns: a solve(matvec, b) must not change them."
    _checks.flatten_v(call, z_star, op._zs, w)
    _check_stationary(call, op)
    x = _solve(call, op, w, tol, maxiter, solve)
    op._versions.check()  # the solve ran the caller's code: the mixed term below must see the operator's state
    mixed = mixed_grad(f, G, z_star, y, x)
    return tree_unflatten([-leaf for leaf in tree_flatten(mixed)[0]], tree_flatten(mixed)[1]), op


@public_call
def implicit_grad(f: Callable[..., torch.Tensor], G: Callable[..., Any],
                  z_star: Union[torch.Tensor, Sequence[torch.Tensor]], y: Any, w: Any, *, kind: str = "hessian",
                  damping: float = 0.0, tol: float = 1e-6, maxiter: Optional[int] = None,
                  solve: Optional[Callable[..., Any]] = None, segments: Any = "auto", keep_graph: bool = False) -> Any:
    r"""The derivative in y of :math:`\langle w, z^*(y)\rangle`, where :math:`z^*(y) = \arg\min_z f(y, G(z))`.

    .. math::

        \frac{d\,\langle w, z^*\rangle}{dy} = -\Big(\frac{\partial^2 L}{\partial z\,\partial y}\Big)^{\!\top}
        (H_{zz} + \lambda I)^{-1} w

    Steps: x solves :math:`(H_{zz} + \lambda I)\,x = w` (conjugate gradients on
    :func:`mixedad.z_curvature`, or ``solve``), then the result is
    ``-mixed_grad(f, G, z_star, y, x)`` (flat in G's depth). For a prior on z, let G return
    ``(G(z), z)`` and f read both.

    Approximations, stated: with ``damping`` > 0 the result is the derivative of the damped
    problem, no longer exactly :math:`d\langle w, z^*\rangle/dy`; ``kind="ggn"`` replaces
    :math:`H_{zz}` by the Gauss-Newton matrix (exact only at a perfect fit); CG stops at relative
    residual ``tol``. The formula holds at a stationary point: a ``z_star`` whose gradient is
    visibly not zero (more than :data:`STATIONARY_TOLERANCE` of its scale) warns.

    State: the curvature's products leave G's random state and buffers as they were; the final
    mixed_grad leaves them as after one plain forward of G (mixedad's policy: a train-mode
    BatchNorm updates its running statistics once, dropout draws once). Put G in eval mode to
    keep a frozen G's statistics fixed. G, ``z_star`` and y must not change while the call runs
    (a ``solve`` that changes one raises :class:`mixedad.StateChangedError`).

    Cost: one :func:`mixedad.z_curvature` product per CG iteration (see there; the Hessian's is
    about a forward with tangent, a forward, a backward and a double backward of G, one segment
    at a time), one gradient for the stationarity check, and one mixed_grad.

    Args:
        f: ``f(y, g)`` returning a scalar.
        G: the generator.
        z_star: the minimiser, a tensor or a tuple of tensors (``G(*z_star)``); a constant here.
        y: tensor or pytree of tensors.
        w: the direction in z-space, with z's structure (the gradient of an outer loss at z*).
        kind: keyword-only; "hessian" (default, exact) or "ggn" (Gauss-Newton).
        damping: keyword-only; :math:`\lambda \ge 0`.
        tol, maxiter: keyword-only; for conjugate gradients (see :meth:`ZCurvature.solve`).
        solve: keyword-only; None, or ``solve(matvec, b) -> x`` with b and x of z's structure,
            the caller's own solver (``tol`` and ``maxiter`` are then not used).
        segments, keep_graph: keyword-only; as for :func:`mixedad.z_curvature`.

    Returns:
        Tensors with y's structure.

    Raises:
        mixedad.CurvatureError: CG meets a direction of non-positive curvature (add damping).

    Example:
        >>> import torch, mixedad
        >>> A = torch.tensor([[2.0, 0.0], [0.0, 4.0]], dtype=torch.float64)
        >>> G = lambda z: A @ z
        >>> f = lambda y, g: 0.5 * ((g - y) ** 2).sum()
        >>> y = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> z_star = torch.linalg.solve(A, y)              # argmin: A z = y, so dz*/dy = A^-1
        >>> mixedad.implicit_grad(f, G, z_star, y, torch.tensor([1.0, 0.0], dtype=torch.float64))
        tensor([0.5000, 0.0000], dtype=torch.float64)
    """
    call = "implicit_grad(f, G, z_star, y, w)"
    return _implicit(call, f, G, z_star, y, w, kind, damping, tol, maxiter, solve, segments, keep_graph)[0]


class _ImplicitArgmin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, settings, *y_leaves):
        ctx.settings = settings
        ctx.save_for_backward(*[leaf.detach() for leaf in y_leaves])
        zs = settings["zs"]
        return tuple(z.detach().clone() for z in zs)

    @staticmethod
    def backward(ctx, *w):
        s = ctx.settings
        if torch.is_grad_enabled():  # backward(create_graph=True): the derivative of this gradient is not built
            raise RuntimeError(f"{s['call']}: its gradient can be differentiated once; create_graph=True through it "
                               f"would silently drop the second-order terms. Differentiate without create_graph, or "
                               f"unroll the inner optimisation for higher orders.")
        state = s["state"]
        # Checked before autograd's own check of y, with the parameter's or input's name; G as the caller has it now
        # after.
        with s["versions"].replaying(state):
            y_leaves = list(ctx.saved_tensors)
            ws = [torch.zeros_like(z) if wi is None else wi for wi, z in zip(w, s["zs"])]
            y = tree_unflatten(y_leaves, s["y_spec"])
            state.restore()  # the random state, buffers and modes of the call
            grads, _ = _implicit(s["call"], s["f"], s["G"], s["z_star"], y, tuple(ws) if s["tuple"] else ws[0],
                                 s["kind"], s["damping"], s["tol"], s["maxiter"], s["solve"], s["segments"],
                                 s["keep_graph"])
        return (None, *tree_flatten(grads)[0])


@public_call
def implicit_argmin(f: Callable[..., torch.Tensor], G: Callable[..., Any],
                    z_star: Union[torch.Tensor, Sequence[torch.Tensor]], y: Any, *, kind: str = "hessian",
                    damping: float = 0.0, tol: float = 1e-6, maxiter: Optional[int] = None,
                    solve: Optional[Callable[..., Any]] = None, segments: Any = "auto", keep_graph: bool = False) -> Any:
    r"""``z_star`` as a differentiable function of y: backward through it is :func:`implicit_grad`.

    .. math::

        z^*(y) = \arg\min_z f(y, G(z)), \qquad
        \bar y \mathrel{+}= -\Big(\frac{\partial^2 L}{\partial z\,\partial y}\Big)^{\!\top} (H_{zz} + \lambda I)^{-1} \bar z^*

    Returns a copy of ``z_star`` (its values; a tuple for a tuple) attached to the autograd graph
    of y's leaves that require grad: ``loss(implicit_argmin(f, G, z_star, y)).backward()``
    reaches y (and whatever y was computed from), as through an unrolled optimiser, at the
    memory of one curvature solve. The keywords are those of :func:`implicit_grad`. Find
    ``z_star`` however you like (under ``torch.no_grad()``, with any optimiser); only its value
    is used. The arguments are checked here; the work happens in backward, once per backward.
    Each backward runs from G's state at this call, as the naive unrolled code's backward would
    see it: the random state, G's train-mode buffers, small eval-mode buffers and module modes
    are copied here (a snapshot) and replayed, and G is left as the backward found it. What is
    not copied (G's parameters, eval-mode buffers too large to copy, ``z_star`` and y's leaves)
    is checked against its version at this call (``tensor._version``, as autograd does): a
    change in place, or a replaced parameter, raises :class:`mixedad.StateChangedError`. For a G
    that is not an ``nn.Module``, the modules are those its closure, defaults, named globals or
    bound object hold (directly or in a list, tuple or dict). Its gradient can be differentiated once: ``create_graph=True`` through it
    raises.

    Example:
        >>> import torch, mixedad
        >>> A = torch.tensor([[2.0, 0.0], [0.0, 4.0]], dtype=torch.float64)
        >>> f = lambda y, g: 0.5 * ((g - y) ** 2).sum()
        >>> y = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
        >>> z_star = torch.linalg.solve(A, y.detach())
        >>> mixedad.implicit_argmin(f, lambda z: A @ z, z_star, y).sum().backward()
        >>> y.grad
        tensor([0.5000, 0.2500], dtype=torch.float64)
    """
    call = "implicit_argmin(f, G, z_star, y)"
    zs, y_leaves, y_spec, _ = _checks.mixed_args(call, f, G, z_star, y, None)
    _check_settings(call, kind=kind, damping=damping, keep_graph=keep_graph, tol=tol, maxiter=maxiter, solve=solve)
    if not (isinstance(segments, (str, int, list, tuple)) and not isinstance(segments, bool)):
        raise TypeError(f"{call}: expected segments='auto', an int or a list of callables, got {segments!r}.")
    G = eager(G)
    # The backward runs from G's state at this call: the snapshot replays what it copied, the rest is checked. One
    # forward of G, undone, tells which tensors the backward will read (a tensor G closes over included).
    state = Snapshot(G, modules=modules_reached(G), call=call)
    try:
        with state.watching(reads=True), torch.no_grad():
            G(*zs)
    finally:
        state.restore()
    versions = Versions(call, G, [state], list(zip(input_labels("z_star", z_star) + input_labels("y", y),
                                                   [*zs, *y_leaves])),
                        after="the call that saved this backward pass",
                        fix="Call implicit_argmin again after the change and backpropagate through the new result.")
    settings = {"call": call, "f": f, "G": G, "z_star": z_star, "zs": zs, "tuple": isinstance(z_star, (tuple, list)),
                "y_spec": y_spec, "kind": kind, "damping": damping, "tol": tol, "maxiter": maxiter, "solve": solve,
                "segments": segments, "keep_graph": keep_graph, "state": state, "versions": versions}
    out = _ImplicitArgmin.apply(settings, *y_leaves)
    return tuple(out) if settings["tuple"] else out[0]
