"""One pass at a time per thread: a mixedad call inside G is refused by name, and the mark is cleared."""
import pytest
import torch

import mixedad
from mixedad._ground.nesting import NestedCallError, check_not_nested, one_pass

F64 = torch.float64


def test_the_mark_names_the_outer_call_and_is_cleared_even_on_error():
    with pytest.raises(ValueError):
        with one_pass("outer(f, G)"):
            with pytest.raises(NestedCallError, match=r"inner\(\): called inside G while outer\(f, G\)"):
                check_not_nested("inner()")
            raise ValueError
    check_not_nested("after()")


def test_mixed_grad_inside_g_is_refused_and_the_next_call_works():
    W = torch.randn(3, 3, dtype=F64)
    f = lambda y, g: ((y + g) ** 2).sum()  # noqa: E731

    def G(z):
        mixedad.mixed_grad(f, lambda x: x @ W, z.detach(), torch.zeros(2, 3, dtype=F64))
        return z @ W

    z, y = torch.randn(2, 3, dtype=F64), torch.randn(2, 3, dtype=F64)
    with pytest.raises(NestedCallError, match="cannot nest"):
        mixedad.mixed_grad(f, G, z, y)
    assert mixedad.mixed_grad(f, lambda x: x @ W, z, y).shape == (2, 3)
