"""mixedad.testing: relative errors that never call a NaN close."""
import math

import pytest
import torch

from mixedad.testing import assert_close, max_relative_error


def test_relative_error_values():
    e = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)
    assert max_relative_error(e, e) == 0.0
    assert max_relative_error(e + torch.tensor([0.0, 0.0, 0.4], dtype=torch.float64), e) == pytest.approx(0.1)
    assert max_relative_error({"a": e, "b": (e,)}, {"a": e, "b": (e * 1.5,)}) == pytest.approx(1 / 3)


def test_nan_and_inf_are_never_close():
    e = torch.tensor([1.0, 2.0])
    assert math.isinf(max_relative_error(torch.tensor([1.0, float("nan")]), e))
    assert math.isinf(max_relative_error(torch.tensor([1.0, float("inf")]), e))
    both = torch.tensor([1.0, float("nan")])
    assert max_relative_error(both, both) == 0.0


def test_structure_mismatch_and_report():
    with pytest.raises(ValueError, match="matching structures"):
        max_relative_error((torch.ones(2),), [torch.ones(2)])
    with pytest.raises(ValueError, match="matching shapes"):
        max_relative_error(torch.ones(2), torch.ones(3))
    with pytest.raises(AssertionError, match=r"mine: max relative error 1.000e\+00 exceeds 1.0e-09\n  leaf 0"):
        assert_close(torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64), what="mine")
