"""Helpers for verifying mixedad's results against a reference, in tests, notebooks and the demo."""
from typing import Any, Callable, Dict, List, Optional, TextIO
import torch

from mixedad._hooks.pytree import tree_flatten

__all__ = ["max_relative_error", "assert_close", "check_generator", "spot_check", "RTOL", "ROUNDOFF_EPS", "PROBES"]

#: Default relative tolerances by dtype, for comparing mixedad with a reference.
RTOL: Dict[torch.dtype, float] = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2,
                                  torch.bfloat16: 1e-2}


#: Round-off allowed by :func:`spot_check`, in units of the dtype's eps times the size of the
#: terms that make each entry. Measured here: float64 and float32 honest results differ by at
#: most about 14 such units (the zoo, and MLPs of depth 1 to 16 whose exact answer is zero).
ROUNDOFF_EPS: int = 64


def _check_atol(call, atol):
    if isinstance(atol, bool) or not isinstance(atol, (int, float)):
        raise TypeError(f"{call}: expected atol to be a float, got {type(atol).__name__}.")
    if not 0 <= atol < float("inf"):
        raise ValueError(f"{call}: expected atol to be non-negative and finite, got {atol!r}.")


def _pairs(actual, expected):
    a_leaves, a_spec = tree_flatten(actual)
    e_leaves, e_spec = tree_flatten(expected)
    if a_spec != e_spec:
        raise ValueError(f"expected matching structures, got {a_spec} and {e_spec}.")
    for a, e in zip(a_leaves, e_leaves):
        if a.shape != e.shape:
            raise ValueError(f"expected matching shapes, got {tuple(a.shape)} and {tuple(e.shape)}.")
    return list(zip(a_leaves, e_leaves))


def max_relative_error(actual: Any, expected: Any, *, atol: float = 0.0) -> float:
    r"""Largest leafwise relative error between two tensors or pytrees of tensors, beyond ``atol``.

    .. math::

        \max_{\text{leaves}}\ \frac{\max\big(\max_i |a_i - e_i| - \mathrm{atol},\ 0\big)}
            {\max(\max_i |e_i|,\ \mathrm{tiny})}

    with tiny the smallest normal float64. The error is at most ``rtol`` exactly when every
    leaf has :math:`\max_i |a_i - e_i| \le \mathrm{rtol} \max_i |e_i| + \mathrm{atol}`.

    **Round-off.** With ``atol=0`` an all-zero expected leaf compares absolutely, so a leaf that
    is zero in exact arithmetic, where both sides hold round-off, counts as a large error. Pass
    an ``atol`` of that round-off's size: a small multiple of the dtype's eps times the size of
    the terms that cancel. The results cannot tell that size (when the whole answer is zero
    they are round-off themselves); :func:`spot_check` estimates it from f and G.

    Example:
        >>> import torch
        >>> from mixedad.testing import max_relative_error
        >>> max_relative_error(torch.tensor([1.0, 2.1]), torch.tensor([1.0, 2.0]))  # doctest: +ELLIPSIS
        0.0499...
        >>> max_relative_error(torch.tensor([3e-17]), torch.tensor([-2e-17]), atol=1e-15)
        0.0
    """
    _check_atol("max_relative_error(actual, expected)", atol)
    worst = 0.0
    for a, e in _pairs(actual, expected):
        a, e = a.detach().double().cpu(), e.detach().double().cpu()
        if a.numel() == 0:
            continue
        finite = e.isfinite()
        # Non-finite entries must match exactly (NaN with NaN, inf with inf); a NaN or overflow
        # that the reference does not have is never "close".
        if not torch.equal(a.isfinite(), finite) or not torch.equal(
            a[~finite].nan_to_num(), e[~finite].nan_to_num()
        ):
            return float("inf")
        if not finite.any():
            continue
        a, e = a[finite], e[finite]
        diff = max((a - e).abs().max().item() - atol, 0.0)
        scale = max(e.abs().max().item(), torch.finfo(torch.float64).tiny)
        worst = max(worst, diff / scale)
    return worst


def assert_close(actual: Any, expected: Any, *, rtol: Optional[float] = None, atol: float = 0.0,
                 what: str = "result") -> None:
    r"""Assert ``max_relative_error(actual, expected, atol=atol) <= rtol`` with a readable report.

    .. math::

        \max_i |a_i - e_i| \le \mathrm{rtol} \max_i |e_i| + \mathrm{atol}
        \quad\text{for every leaf}

    ``rtol`` defaults to :data:`RTOL` for the expected dtype (1e-9 in float64). ``atol`` (default
    0) is the round-off allowed on leaves that are zero in exact arithmetic: see
    :func:`max_relative_error`. On failure the message gives the error and, per leaf, its shape,
    dtype and largest differences.

    Example:
        >>> import torch
        >>> from mixedad.testing import assert_close
        >>> assert_close(torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
    """
    _check_atol("assert_close(actual, expected)", atol)
    pairs = _pairs(actual, expected)
    if rtol is None:
        rtol = max(RTOL.get(e.dtype, 1e-4) for _, e in pairs)
    err = max_relative_error(actual, expected, atol=atol)
    if not err <= rtol:
        beyond = f" (beyond atol {atol:.1e})" if atol else ""
        lines = [f"{what}: max relative error{beyond} {err:.3e} exceeds {rtol:.1e}"]
        for i, (a, e) in enumerate(pairs):
            lines.append(
                f"  leaf {i}: shape {tuple(e.shape)}, dtype {e.dtype}, "
                f"max|actual-expected| {(a.detach() - e.detach()).abs().max().item():.3e}, "
                f"max|expected| {e.detach().abs().max().item():.3e}"
            )
        raise AssertionError("\n".join(lines))


def check_generator(G: Callable[..., Any], z: torch.Tensor, *, strategy: str = "forward",
                    rtol: Optional[float] = None, seed: int = 0) -> float:
    r"""Check that mixedad's tangents through G agree with reverse mode: the dot-product test.

    .. math::

        \langle u,\ J_G(z)\, v\rangle \;=\; \langle J_G(z)^\top u,\ v\rangle

    for random v and u, with :math:`J_G v` pushed by mixedad (``strategy`` as in
    :func:`mixedad.mixed_grad`) and :math:`J_G^\top u` from an ordinary backward pass. mixedad
    detects outputs whose tangent is lost entirely; this also catches a G that loses part of a
    tangent (a custom op or compiled region that drops it while reverse mode still works). Run
    it once on a small batch, ideally in float64, when you bring a new G. Uses and restores the
    global RNG and G's buffers. G is run in its current mode; put it in eval mode first, or
    dropout will draw different masks in the two passes.

    Returns:
        The relative difference (a float). Raises AssertionError with a report if it exceeds
        ``rtol`` (default: :data:`RTOL` for z's dtype, times 10).

    Example:
        >>> import torch, mixedad
        >>> from mixedad.testing import check_generator
        >>> G = mixedad.zoo.dcgan(dtype=torch.float64)
        >>> check_generator(G, torch.randn(2, 16, dtype=torch.float64)) < 1e-10
        True
    """
    from mixedad._checks import flatten_z
    from mixedad._hooks.function_apply import routing
    from mixedad.op_rules._custom_functions import CheckpointsRunDirectly
    from mixedad._ground.inputs import writable
    from mixedad._ground.state import Snapshot
    from mixedad._entry import eager, frozen
    from mixedad._frontend.tangents import push_tangent

    call = "check_generator(G, z)"
    zs = flatten_z(call, z)
    G = eager(G)
    gen = torch.Generator().manual_seed(seed)
    vs = [torch.randn(zi.shape, generator=gen, dtype=zi.dtype).to(zi.device) for zi in zs]
    snapshot = Snapshot(G, call=call)
    try:
        g_leaves, tangents, _ = push_tangent(call, G, zs, vs, strategy=strategy)
        snapshot.restore()
        us = [torch.randn(g.shape, generator=gen, dtype=g.dtype).to(g.device) if t is not None else None
              for g, t in zip(g_leaves, tangents)]
        with torch.enable_grad(), routing(CheckpointsRunDirectly()):
            z_work = [zi.detach().requires_grad_() for zi in zs]
            outs, _ = tree_flatten(frozen(G)(*writable(z_work)))
            pairs = [(o, u) for o, u in zip(outs, us) if u is not None and o.requires_grad]
            pulled = torch.autograd.grad([o for o, _ in pairs], z_work, [u for _, u in pairs],
                                         allow_unused=True) if pairs else [None] * len(z_work)
    finally:
        snapshot.restore()
    forward = float(sum((u.double() * t.double()).sum() for u, t in zip(us, tangents) if t is not None and u is not None))
    reverse = float(sum((p.double() * v.double()).sum() for p, v in zip(pulled, vs) if p is not None))
    err = abs(forward - reverse) / max(abs(reverse), abs(forward), torch.finfo(torch.float64).tiny)
    if rtol is None:
        rtol = 10 * RTOL.get(zs[0].dtype, 1e-4)
    if not err <= rtol:
        raise AssertionError(
            f"{call}: <u, J v> by mixedad's tangents is {forward:.6e}, <J^T u, v> by reverse mode is "
            f"{reverse:.6e} (relative difference {err:.2e} > {rtol:.0e}). G loses or corrupts "
            f"forward-mode tangents; use strategy='reverse' for it."
        )
    return err


def spot_check(f: Callable[..., torch.Tensor], G: Callable[..., Any], z: torch.Tensor, y: Any, v: Any = None, *, codes: int = 2, strategy: str = "auto", rtol: Optional[float] = None,
               stream: Optional[TextIO] = None) -> float:
    r"""Check one real call of :func:`mixedad.mixed_grad` against double backward on a few codes.

    .. math::

        \max |a - e| \le \mathrm{rtol}\, \max |e| + \min(64\,\varepsilon, \mathrm{rtol})\, s
        \quad\text{per leaf of y, where}\quad
        a = \mathrm{mixed\_grad}(f, G, z_{:k}, y_{:k}, v_{:k}),\
        e = \mathrm{double\_backward}(f, G, z_{:k}, y_{:k}, v_{:k})

    with :math:`k` = ``codes``, :math:`\varepsilon` the dtype's eps (64 is :data:`ROUNDOFF_EPS`)
    and :math:`s` the size of the terms whose sums make the leaf's entries,
    :math:`s^2 \approx \max_j \sum_i (v_i\, \partial^2 f / \partial y_j \partial z_i)^2`,
    estimated by two more mixed_grad calls along v with random signs. The second term is the
    round-off of those sums: it lets an answer that is zero in exact arithmetic, where both
    sides are round-off, pass, and hides no error larger than round-off.

    PyTorch's own forward-mode formulas are sometimes silently wrong
    (pytorch#198017): this runs the call you are about to make, on the first ``codes`` latent
    codes along z's dim 0, both ways, and prints a short report. A leaf of y (or v) is sliced
    too when its dim 0 has z's length; others are used whole. Double backward's memory grows
    with G's depth, which is why only a slice is checked; the other three calls are flat in
    depth. G's random state and buffers are restored between and after the calls, so dropout
    draws the same masks in all.

    Args:
        f, G, z, y, v: as for :func:`mixedad.mixed_grad` (z a tensor).
        codes: keyword-only; how many latent codes to check (default 2).
        strategy: keyword-only; as for :func:`mixedad.mixed_grad`.
        rtol: keyword-only; default :data:`RTOL` for z's dtype.
        stream: keyword-only; where the report goes (standard output by default; None prints).

    Returns:
        The relative error beyond the allowed round-off (a float, :func:`max_relative_error`
        with that ``atol``). Raises AssertionError with the report when it exceeds rtol.

    Example:
        >>> import io, torch, mixedad
        >>> from mixedad.testing import spot_check
        >>> G, f = mixedad.zoo.mlp(3, 8, dtype=torch.float64), lambda y, g: ((y + g) ** 3).sum()
        >>> z, y = torch.randn(100, 8, dtype=torch.float64), torch.randn(100, 8, dtype=torch.float64)
        >>> spot_check(f, G, z, y, stream=io.StringIO()) < 1e-9
        True
    """
    import sys

    from mixedad._checks import check_float_tensor
    from mixedad._hooks.pytree import tree_map
    from mixedad.mixed import mixed_grad
    from mixedad.reference import double_backward_mixed_grad
    from mixedad._ground.state import Snapshot
    from mixedad._entry import eager

    call = "spot_check(f, G, z, y)"
    check_float_tensor(call, "z", z)
    if z.dim() == 0:
        raise ValueError(f"{call}: expected z with a dim 0 of latent codes, got a 0-d z.")
    if isinstance(codes, bool) or not isinstance(codes, int) or codes < 1:
        raise ValueError(f"{call}: expected codes to be a positive int, got {codes!r}.")
    n = z.shape[0]
    cut = lambda t: t[:codes] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == n else t  # noqa: E731
    z_s, y_s = z[:codes], tree_map(cut, y)
    v_s = None if v is None else cut(v)
    G = eager(G)
    if rtol is None:
        rtol = RTOL.get(z.dtype, 1e-4)
    undo = Snapshot(G, call=call)
    try:
        with undo.watching():
            try:
                ours = mixed_grad(f, G, z_s, y_s, v_s, strategy=strategy)
            except (IndexError, RuntimeError) as error:
                raise ValueError(
                    f"{call}: mixed_grad on z[:{codes}] (and y's and v's leaves cut the same way where dim 0 "
                    f"has z's size {n}) failed: {error}. spot_check takes dim 0 of z to index latent "
                    f"codes; where it does not (a sequence-first RNN input, say), pass z and y of a few "
                    f"codes yourself with codes equal to z's dim 0."
                ) from error
        undo.restore()  # the probes and double backward see the state mixed_grad saw
        sizes = _term_sizes(f, G, z_s, y_s, v_s, strategy, undo)
        expected = double_backward_mixed_grad(f, G, z_s, y_s, v_s)
    finally:
        undo.restore()
    pairs = _pairs(ours, expected)
    atols = [min(ROUNDOFF_EPS * torch.finfo(e.dtype).eps, rtol) * size for (_, e), size in zip(pairs, sizes)]
    err = max((max_relative_error(a, e, atol=atol) for (a, e), atol in zip(pairs, atols)), default=0.0)
    verdict = "ok" if err <= rtol else "MISMATCH"
    report = (f"{call}: {min(codes, n)} of {n} latent codes, mixed_grad (strategy={strategy!r}) against double "
              f"backward: max relative error {err:.2e} (rtol {rtol:.0e}, round-off allowed up to "
              f"{max(atols, default=0.0):.1e}) {verdict}")
    print(report, file=sys.stdout if stream is None else stream)
    if err > rtol:
        raise AssertionError(report + ". mixedad's tangents disagree with reverse mode on this G: run "
                             "mixedad.tangent_report(G, z) to see which ops took which path, and use "
                             "strategy='reverse' for G meanwhile.")
    return err


#: How many Gaussian probes :func:`spot_check` averages to size the terms of each entry.
PROBES: int = 2


def _term_sizes(f, G, z, y, v, strategy, undo):
    r"""Per leaf of y, the size of the terms whose sums make the entries of the mixed derivative.

    .. math::

        R_j(v) = \sum_i v_i M_{ji}, \quad M_{ji} = \frac{\partial^2 f}{\partial y_j\, \partial z_i},
        \qquad \mathbb{E}_\xi\, R_j(v \circ \xi)^2 = \sum_i (v_i M_{ji})^2

    for standard normal :math:`\xi`: the mixed derivative along :math:`v \circ \xi` has random
    signs on the terms, so they no longer cancel, and its mean square over :data:`PROBES` draws
    estimates the squared size of the terms. Returns, per leaf, the largest root mean square
    over its entries. The draws use a fixed seed, not the global RNG; ``undo`` puts G's state
    back after each probe. A tangent that mixedad gets wrong inflates this size only as much as
    it inflates its own error, which the allowed round-off (eps times the size) cannot hide.
    """
    from mixedad.mixed import mixed_grad

    gen = torch.Generator().manual_seed(0)
    v = torch.ones_like(z) if v is None else v
    total: Optional[List[torch.Tensor]] = None
    for _ in range(PROBES):
        xi = torch.randn(v.shape, generator=gen, dtype=torch.float64).to(dtype=v.dtype, device=v.device)
        leaves, _ = tree_flatten(mixed_grad(f, G, z, y, v * xi, strategy=strategy))
        undo.restore()
        squares = [leaf.detach().double().square().nan_to_num(0.0, 0.0, 0.0) for leaf in leaves]
        total = squares if total is None else [t + s for t, s in zip(total, squares)]
    assert total is not None  # PROBES >= 1
    return [(t / PROBES).sqrt().max().item() if t.numel() else 0.0 for t in total]
