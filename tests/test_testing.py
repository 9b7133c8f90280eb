"""mixedad.testing: relative errors that never call a NaN close."""
import io
import math
import re

import pytest
import torch
from torch.autograd import forward_ad

import mixedad
from mixedad.reference import double_backward_mixed_grad
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
    from mixedad.op_rules import Path, skipping

    def G(z):
        a = z @ z.mT + 4 * torch.eye(z.shape[-1], dtype=z.dtype)
        return torch.cholesky_inverse(torch.linalg.cholesky(a))

    f = lambda y, g: ((y + g) ** 3).sum()  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    z, y = (torch.randn(10, 3, 3, dtype=torch.float64, generator=gen) for _ in range(2))
    with skipping(Path.LOCAL), pytest.raises(AssertionError, match=r"spot_check\(f, G, z, y\): 2 of 10 latent codes.*MISMATCH"):
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
    with pytest.warns(RuntimeWarning, match=r"WrongJvp.jvp disagrees with the backward.*differentiates the backward"):
        spot_check(f, G, z, y, stream=io.StringIO())


def test_atol_allows_round_off_only():
    zero, noise = torch.zeros(3, dtype=torch.float64), torch.tensor([1e-17, -3e-17, 2e-17], dtype=torch.float64)
    assert max_relative_error(noise, zero) > 1e200  # absolute against zero: round-off is "huge"
    assert max_relative_error(noise, zero, atol=1e-15) == 0.0
    assert max_relative_error(noise, -noise, atol=1e-17) == pytest.approx((6e-17 - 1e-17) / 3e-17)
    e = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert max_relative_error(e * 1.001, e, atol=1e-15) == pytest.approx(1e-3)  # a real error stays
    assert_close(noise, zero, atol=1e-15)
    with pytest.raises(AssertionError, match=r"max relative error \(beyond atol 1.0e-17\)"):
        assert_close(noise, zero, atol=1e-17)
    for fn in (max_relative_error, assert_close):
        with pytest.raises(TypeError, match=r"\(actual, expected\): expected atol to be a float, got str"):
            fn(e, e, atol="1e-9")
        with pytest.raises(ValueError, match=r"\(actual, expected\): expected atol to be non-negative and finite, got -1"):
            fn(e, e, atol=-1.0)


def centred_G(dtype):
    """A shift of z along ones changes nothing: J_G 1 = 0, computed with round-off (7 is no power of 2)."""
    W = torch.randn(7, 7, generator=torch.Generator().manual_seed(1), dtype=dtype)
    return lambda z: torch.tanh((z - z.mean(-1, keepdim=True)) @ W)


def doubling_G(dtype):
    return lambda z: 2 * z


def off_by_1e3(make_G):
    """make_G's G, whose forward-mode tangent alone gains 1e-3 of v: a silently wrong formula."""
    def make(dtype):
        G = make_G(dtype)

        def wrong(z):
            out = G(z)
            if forward_ad.unpack_dual(z).tangent is not None:
                out = out + 2e-3 * (z - z.detach())
            return out
        return wrong
    return make


def along_ones(z, gen):
    return torch.randn(z.shape[0], 1, generator=gen, dtype=z.dtype).expand_as(z).contiguous()


def generic(z, gen):
    return torch.randn(z.shape, generator=gen, dtype=z.dtype)


# (G for a dtype, v for z, whether spot_check passes)
SPOT_CASES = {
    "exact zero, both sides round-off": (centred_G, along_ones, True),
    "honest, nonzero": (centred_G, generic, True),
    "1e-3 wrong, nonzero": (off_by_1e3(doubling_G), generic, False),
    "1e-3 of the terms wrong, exact zero": (off_by_1e3(centred_G), along_ones, False),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", SPOT_CASES)
def test_spot_check_allows_round_off_but_not_a_wrong_tangent(case, dtype):
    make_G, make_v, passes = SPOT_CASES[case]
    f = lambda y, g: ((y + g) ** 3).sum()  # noqa: E731
    gen = torch.Generator().manual_seed(4)  # a seed whose exact zeros come out as round-off in both dtypes
    z, y = torch.randn(4, 7, generator=gen, dtype=dtype), torch.randn(4, 7, generator=gen, dtype=dtype)
    v, G = make_v(z, gen), make_G(dtype)
    rtol = mixedad.testing.RTOL[dtype]
    if case.startswith("exact zero"):  # the flaw: relative to an answer that is itself round-off
        ours, naive = mixedad.mixed_grad(f, G, z[:2], y[:2], v[:2]), double_backward_mixed_grad(f, G, z[:2], y[:2], v[:2])
        assert 0 < naive.abs().max() < 1e3 * torch.finfo(dtype).eps and max_relative_error(ours, naive) > rtol
    out = io.StringIO()
    if passes:
        assert spot_check(f, G, z, y, v, stream=out) <= rtol
        assert out.getvalue().endswith("ok\n")
    else:
        with pytest.raises(AssertionError, match=r"max relative error (\S+) .*MISMATCH") as caught:
            spot_check(f, G, z, y, v, stream=out)
        assert float(re.search(r"max relative error (\S+)", str(caught.value)).group(1)) > 0.5e-3
