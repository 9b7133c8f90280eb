"""Sketches of a pass's outputs: equal leaves alike bit for bit, differences read to their size, little memory."""
import math

import pytest
import torch

from mixedad._programs import sketch
from mixedad.profiling import cpu_peak_memory

BOUNDS = dict(round_off=1000, cap=1e-2)


def _differs(a, b, floor=1.0):
    return sketch.differs(sketch.sketches(a), sketch.sketches(b), floor, **BOUNDS)


def test_equal_leaves_in_other_layouts_have_equal_sketches():
    x = torch.randn(3, 8, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    layouts = [x, x.contiguous(memory_format=torch.channels_last), x.transpose(0, 1).contiguous().transpose(0, 1)]
    first = sketch.sketches([x])
    for other in layouts:
        assert sketch.sketches([other]) == first
    assert _differs([x.float()], [layouts[1].float()]) == 0.0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["spread", "one element", "two elements"])
def test_a_difference_is_read_to_within_a_few_times_its_size(seed, kind):
    gen = torch.Generator().manual_seed(seed)
    b = torch.randn(4, 7, 9, dtype=torch.float64, generator=gen)
    d = torch.zeros_like(b)
    if kind == "spread":
        d = torch.randn(b.shape, dtype=torch.float64, generator=gen)
    else:
        d.view(-1)[: 1 if kind == "one element" else 2] = 1.0
    d *= 1e-4 * b.norm() / d.norm()
    estimate = _differs([b + d], [b])
    assert 1e-4 / 3 <= estimate <= 1e-4 * 3, estimate


def test_what_does_not_match():
    x = torch.randn(2, 3)
    nan = x.clone()
    nan[0, 0] = float("nan")
    assert _differs([None], [torch.zeros(2)]) == 0.0
    assert _differs([None], [torch.ones(2)]) == math.inf
    assert _differs([x], [x.double()]) == math.inf  # dtypes
    assert _differs([x], [x[:1]]) == math.inf  # shapes
    assert _differs([nan], [nan]) == math.inf
    assert _differs([3], [3]) == 0.0 and _differs([3], [4]) == math.inf  # values that are no tensor
    assert _differs([torch.arange(5)], [torch.arange(5)]) == 0.0
    assert _differs([torch.arange(5)], [torch.arange(5).flip(0)]) == math.inf  # integers: equal, or not at all
    assert _differs([x], [x, x]) == math.inf  # leaves


def test_round_off_of_a_zero_tangent_matches_and_a_dropped_tangent_does_not():
    inputs = [torch.ones(100)]
    floor = sketch.rms_floor(inputs)
    assert floor == 1.0
    tiny = torch.full((10,), 1e-6)  # round-off of a tangent that is zero in exact arithmetic (float32)
    assert sketch.differs(sketch.sketches([tiny]), sketch.sketches([-tiny]), floor, **BOUNDS) == 0.0
    dropped = sketch.differs(sketch.sketches([torch.zeros(10)]), sketch.sketches([torch.ones(10)]), floor, **BOUNDS)
    assert dropped > 0.5


@pytest.mark.parametrize("x", [torch.randn(8, 64, 32, 32).contiguous(memory_format=torch.channels_last),
                               torch.randn(1, 3, 256, 256).half(), torch.randn(4096)],
                         ids=["channels_last", "half", "flat"])
def test_a_sketch_holds_a_64th_of_its_leaf_and_its_few_numbers(x):
    few_numbers = 64 * sketch.PROJECTIONS  # the projections, and one element's draws and products
    for fn in (sketch.sketches, sketch.rms_floor):
        _, peak = cpu_peak_memory(fn, [x])
        assert 0 < peak <= x.untyped_storage().nbytes() / 64 + few_numbers, fn
