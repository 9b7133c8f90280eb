r"""Comparing two passes' outputs with one pass's outputs alive at a time: random projections per leaf.

The default's check (:func:`mixedad._programs.cache.push_program`) runs G's program, keeps a sketch of each
output leaf (its sum of squares and :data:`PROJECTIONS` random projections) and lets the leaves go, then runs the
per-op pass from the same state and sketches its leaves the same way. Holding both passes' outputs at once would
cost their size on top of the larger pass's peak (docs/performance.md, "Measurements behind the design"); a sketch costs a few numbers, and the pieces it converts while it reads a leaf are at most 1/64 of
the leaf's bytes. With :math:`r_j` standard Gaussian vectors drawn from a fixed seed:

.. math::

    s_j(x) = \langle r_j, x \rangle, \qquad
    \widehat{\lVert a - b \rVert^2} = \frac{1}{k} \sum_{j=1}^{k} \big(s_j(a) - s_j(b)\big)^2
    \sim \lVert a - b \rVert^2 \, \frac{\chi^2_k}{k}

for any fixed :math:`a - b`, exactly (no assumption on its structure). With :math:`k = 16`, a difference is read
below half its size with probability :math:`1.1 \cdot 10^{-3}`, below a fifth with :math:`2 \cdot 10^{-9}`, and
above twice its size with :math:`10^{-7}`; the check's tolerances lie orders of magnitude between round-off and the
differences a wrong rule makes. Equal leaves have equal sketches bit for bit (every leaf is read in its logical
order, whatever its strides), and norms (:math:`\lVert b \rVert`, the round-off floors) are exact.
"""
import dataclasses
import math
from typing import Any, List, Tuple

import torch

__all__ = ["PROJECTIONS", "Sketch", "sketches", "rms_floor", "differs"]

#: How many random projections a sketch keeps per leaf.
PROJECTIONS = 16
_SEED = 0x5EED
#: A leaf is read in pieces whose converted copies hold at most this fraction of its bytes.
_PIECE_FRACTION = 64


@dataclasses.dataclass(frozen=True)
class Sketch:
    """One tensor leaf, summarised: its shape, dtype, exact sum of squares and random projections."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    sum_of_squares: float
    projections: Tuple[float, ...]

    @property
    def floating(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def rms(self) -> float:
        return math.sqrt(self.sum_of_squares / max(math.prod(self.shape), 1))


def _pieces(x, limit):
    """x's elements in logical (row-major) order, as 1-D pieces of at most ``limit`` elements (each copied only where
    x's strides do not allow a view). The pieces depend on x's shape and ``limit`` alone."""
    if x.numel() <= limit or x.dim() <= 1:
        yield from x.reshape(-1).split(limit)
        return
    per = x[0].numel()
    if per > limit:
        for row in x:
            yield from _pieces(row, limit)
        return
    step = limit // per
    for start in range(0, x.shape[0], step):
        yield x[start:start + step].reshape(-1)


def _limit(x, per_element):
    """Elements per piece, so that a piece's copies (``per_element`` bytes each, beside a copy of the piece in x's
    dtype) hold at most 1/:data:`_PIECE_FRACTION` of x's bytes."""
    return max(1, x.numel() * x.element_size() // (_PIECE_FRACTION * (per_element + x.element_size())))


def _as_real(x):
    x = x.detach()
    return torch.view_as_real(x.resolve_conj()) if x.is_complex() else x


def _sketch(x):
    x = _as_real(x)
    k = PROJECTIONS
    generator = torch.Generator(device=x.device).manual_seed(_SEED)
    projections = torch.zeros(k, dtype=torch.float64, device=x.device)
    squares = torch.zeros((), dtype=torch.float64, device=x.device)
    for piece in _pieces(x, _limit(x, 12 * k + 8)):  # float32 draws, their float64 copy, the piece in float64
        piece = piece.to(torch.float64)
        draws = torch.randn(k, piece.numel(), generator=generator, device=x.device)
        projections += draws.to(torch.float64) @ piece
        squares += torch.dot(piece, piece)
        del piece, draws  # before the next piece is cut
    return Sketch(tuple(x.shape), x.dtype, squares.item(), tuple(projections.tolist()))


def sketches(leaves) -> List[Any]:
    """Each tensor leaf as its :class:`Sketch`; None and values that are no tensor as they are."""
    return [_sketch(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]


def rms_floor(inputs) -> float:
    """The largest root mean square of ``inputs``, read in float64 piece by piece (no copy of a whole input)."""
    floor = 0.0
    for t in inputs:
        t = _as_real(t)
        squares = torch.zeros((), dtype=torch.float64, device=t.device)
        for piece in _pieces(t, _limit(t, 8)):
            piece = piece.to(torch.float64)
            squares += torch.dot(piece, piece)
            del piece
        floor = max(floor, math.sqrt(squares.item() / max(t.numel(), 1)))
    return floor


def differs(program, per_op, floor: float, *, round_off: float, cap: float) -> float:
    r"""The largest relative difference of matching leaves, estimated from their sketches, or inf where they do not
    match.

    .. math::

        \max_i \widehat{\lVert a_i - b_i \rVert} / \lVert b_i \rVert

    As :func:`mixedad._programs.cache._differs` compares whole tensors: None matches None or zeros; leaves that are
    no tensor must be equal; other dtypes than floating point must be equal (their sketches alike); leaves whose root
    mean square both lie below ``round_off`` epsilons of ``floor`` (the eager one also below ``cap`` times ``floor``)
    match; NaN is inf.
    """
    if len(program) != len(per_op):
        return float("inf")
    worst = 0.0
    for a, b in zip(program, per_op):
        if a is None or b is None:
            other = b if a is None else a
            if other is not None and (not isinstance(other, Sketch) or other.sum_of_squares != 0):  # NaN is not 0
                return float("inf")
            continue
        if not isinstance(a, Sketch) or not isinstance(b, Sketch):
            if type(a) is not type(b) or a != b:
                return float("inf")
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return float("inf")
        if not b.floating:
            if a != b:
                return float("inf")
            continue
        if not math.prod(b.shape):
            continue
        loose = round_off * torch.finfo(b.dtype).eps * floor
        if b.rms <= min(loose, cap * floor) and a.rms <= loose:
            continue
        squares = sum((pa - pb) ** 2 for pa, pb in zip(a.projections, b.projections)) / PROJECTIONS
        relative = math.sqrt(squares) / max(math.sqrt(b.sum_of_squares), torch.finfo(torch.float64).tiny)
        if relative != relative:  # NaN
            return float("inf")
        worst = max(worst, relative)
    return worst
