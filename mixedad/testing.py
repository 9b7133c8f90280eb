"""Helpers for verifying mixedad's results against a reference, in tests, notebooks and the demo."""
import torch

from mixedad._trees import tree_flatten

__all__ = ["max_relative_error", "assert_close"]

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
    """Assert ``max_relative_error(actual, expected) <= rtol`` with a readable report.

    ``rtol`` defaults to :data:`RTOL` for the expected dtype (1e-9 in float64).
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
