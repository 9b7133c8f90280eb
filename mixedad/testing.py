"""Helpers for verifying mixedad's results against a reference, in tests, notebooks and the demo."""
import torch

from mixedad._trees import tree_flatten

__all__ = ["max_relative_error", "assert_close", "check_generator"]

#: Default relative tolerances by dtype, for comparing mixedad with a reference.
RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _pairs(actual, expected):
    a_leaves, a_spec = tree_flatten(actual)
    e_leaves, e_spec = tree_flatten(expected)
    if a_spec != e_spec:
        raise ValueError(f"expected matching structures, got {a_spec} and {e_spec}.")
    for a, e in zip(a_leaves, e_leaves):
        if a.shape != e.shape:
            raise ValueError(f"expected matching shapes, got {tuple(a.shape)} and {tuple(e.shape)}.")
    return list(zip(a_leaves, e_leaves))


def max_relative_error(actual, expected):
    r"""Largest leafwise relative error between two tensors or pytrees of tensors.

    .. math::

        \max_{\text{leaves}}\ \frac{\max_i |a_i - e_i|}{\max(\max_i |e_i|,\ \mathrm{tiny})}

    with tiny the smallest normal float64, so that an all-zero expected
    leaf compares absolutely.

    Example:
        >>> import torch
        >>> from mixedad.testing import max_relative_error
        >>> max_relative_error(torch.tensor([1.0, 2.1]), torch.tensor([1.0, 2.0]))  # doctest: +ELLIPSIS
        0.0499...
    """
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
        diff = (a - e).abs().max().item()
        scale = max(e.abs().max().item(), torch.finfo(torch.float64).tiny)
        worst = max(worst, diff / scale)
    return worst


def assert_close(actual, expected, *, rtol=None, what="result"):
    r"""Assert ``max_relative_error(actual, expected) <= rtol`` with a readable report.

    .. math::

        \mathrm{max\_relative\_error}(\mathrm{actual}, \mathrm{expected}) \le \mathrm{rtol}

    ``rtol`` defaults to :data:`RTOL` for the expected dtype (1e-9 in float64). On failure the
    message gives the error and, per leaf, its shape, dtype and largest differences.

    Example:
        >>> import torch
        >>> from mixedad.testing import assert_close
        >>> assert_close(torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
    """
    pairs = _pairs(actual, expected)
    if rtol is None:
        rtol = max(RTOL.get(e.dtype, 1e-4) for _, e in pairs)
    err = max_relative_error(actual, expected)
    if not err <= rtol:
        lines = [f"{what}: max relative error {err:.3e} exceeds {rtol:.1e}"]
        for i, (a, e) in enumerate(pairs):
            lines.append(
                f"  leaf {i}: shape {tuple(e.shape)}, dtype {e.dtype}, "
                f"max|actual-expected| {(a.detach() - e.detach()).abs().max().item():.3e}, "
                f"max|expected| {e.detach().abs().max().item():.3e}"
            )
        raise AssertionError("\n".join(lines))


def check_generator(G, z, *, strategy="forward", rtol=None, seed=0):
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
    from mixedad._function_hook import routing
    from mixedad.op_rules import CheckpointsRunDirectly
    from mixedad.state import Snapshot
    from mixedad.tangents import eager, frozen, push_tangent

    call = "check_generator(G, z)"
    zs = flatten_z(call, z)
    G = eager(G)
    gen = torch.Generator().manual_seed(seed)
    vs = [torch.randn(zi.shape, generator=gen, dtype=zi.dtype).to(zi.device) for zi in zs]
    snapshot = Snapshot(G)
    try:
        g_leaves, tangents, _ = push_tangent(call, G, zs, vs, strategy=strategy)
        snapshot.restore()
        us = [torch.randn(g.shape, generator=gen, dtype=g.dtype).to(g.device) for g in g_leaves]
        with torch.enable_grad(), routing(CheckpointsRunDirectly()):
            z_work = [zi.detach().requires_grad_() for zi in zs]
            outs, _ = tree_flatten(frozen(G)(*z_work))
            pairs = [(o, u) for o, u in zip(outs, us) if o.requires_grad]
            pulled = torch.autograd.grad([o for o, _ in pairs], z_work, [u for _, u in pairs],
                                         allow_unused=True) if pairs else [None] * len(z_work)
    finally:
        snapshot.restore()
    forward = sum((u.double() * t.double()).sum() for u, t in zip(us, tangents))
    reverse = sum((p.double() * v.double()).sum() for p, v in zip(pulled, vs) if p is not None)
    forward, reverse = float(forward), float(reverse)
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
