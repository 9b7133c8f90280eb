"""mixedad.testing: relative errors that never call a NaN close."""
import io
import math

import pytest
import torch

import mixedad
from mixedad.testing import assert_close, max_relative_error, spot_check


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


def test_spot_check_passes_on_an_honest_generator_and_prints_a_report():

    G = mixedad.zoo.mlp(3, 8, dtype=torch.float64).train()
    G.insert(1, torch.nn.Dropout(0.3))
    f = lambda y, g: ((y + g) ** 3).sum()  # noqa: E731
    z, y = torch.randn(50, 8, dtype=torch.float64), torch.randn(50, 8, dtype=torch.float64)
    out = io.StringIO()
    state = torch.get_rng_state()
    assert spot_check(f, G, z, y, codes=3, stream=out) < 1e-9
    assert "3 of 50 latent codes" in out.getvalue() and "ok" in out.getvalue()
    assert torch.equal(state, torch.get_rng_state())


def test_spot_check_catches_a_silently_wrong_formula():
    """PyTorch's known-wrong formula for cholesky_inverse, with mixedad's local rule switched off."""
    from mixedad.op_rules import LOCAL, skipping

    def G(z):
        a = z @ z.mT + 4 * torch.eye(z.shape[-1], dtype=z.dtype)
        return torch.cholesky_inverse(torch.linalg.cholesky(a))

    f = lambda y, g: ((y + g) ** 3).sum()  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    z, y = (torch.randn(10, 3, 3, dtype=torch.float64, generator=gen) for _ in range(2))
    with skipping(LOCAL), pytest.raises(AssertionError, match=r"spot_check\(f, G, z, y\): 2 of 10 latent codes.*MISMATCH"):
        spot_check(f, G, z, y, stream=io.StringIO())
    spot_check(f, G, z, y, stream=io.StringIO())  # with the local rule: exact


def test_a_jvp_that_disagrees_with_its_backward_is_not_trusted():
    """A custom Function whose jvp is wrong: mixedad's dot-product test warns and uses its backward."""

    class WrongJvp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            ctx.x = x
            return x.sin()

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * x.cos()

        @staticmethod
        def jvp(ctx, t):
            return t * ctx.x.cos() * 1.5  # off by half

    G = lambda z: WrongJvp.apply(z)  # noqa: E731
    f = lambda y, g: ((y + g) ** 3).sum()  # noqa: E731
    z, y = torch.randn(10, 4, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match=r"WrongJvp.jvp disagrees with its backward.*differentiates its backward"):
        spot_check(f, G, z, y, stream=io.StringIO())
