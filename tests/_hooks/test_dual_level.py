"""Pins for mixedad._hooks.dual_level: one process-wide forward-AD level, and the C++ entry points."""
import pytest
import torch
from torch.autograd import forward_ad

from mixedad._hooks import dual_level


def test_the_level_global_is_minus_one_outside_and_open_inside():
    assert forward_ad._current_level == -1 and not dual_level.dual_level_open()
    with forward_ad.dual_level():
        assert forward_ad._current_level >= 0 and dual_level.dual_level_open()
        x = dual_level.dual(torch.ones(2), torch.full((2,), 3.0))
        primal, tangent = dual_level.unpack(x)
        assert tangent.tolist() == [3.0, 3.0] and forward_ad.unpack_dual(x).tangent.tolist() == [3.0, 3.0]
        assert dual_level.tangent_of(torch.nn.Parameter(torch.ones(1))) is None
        assert dual_level.any_tangent({"a": [x]})


def test_a_nested_level_raises_from_enter_dual_level_which_the_traceback_shows():
    with forward_ad.dual_level():
        with pytest.raises(RuntimeError) as caught:
            with forward_ad.dual_level():
                pass
    assert dual_level.raised_entering_a_dual_level(caught.value)
    assert not dual_level.raised_entering_a_dual_level(RuntimeError("Nested forward mode AD is not supported"))
