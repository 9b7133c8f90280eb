"""The checks of a tangent against the op's own backward: per signature, outside the pass, counted by plans."""
import random

import pytest
import torch
from torch.autograd import forward_ad

import mixedad
from mixedad.op_rules import _probes
from mixedad.testing import assert_close
from tests.op_rule_generators import SinWithoutJvp

F64 = torch.float64


def _scaled_product(b_scale):
    """x * w with a jvp right in x's term and ``b_scale`` times w's."""

    class Product(torch.autograd.Function):
        @staticmethod
        def forward(x, w):
            return x * w

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs)
            ctx.save_for_forward(*inputs)

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g * w, g * x

        @staticmethod
        def jvp(ctx, dx, dw):
            x, w = ctx.saved_tensors
            return (0 if dx is None else dx * w) + (0 if dw is None else b_scale * dw * x)

    return Product


def _duals(*pairs):
    return [forward_ad.make_dual(p, t) if t is not None else p for p, t in pairs]


def test_a_verdict_holds_for_one_signature_a_new_pattern_or_dtype_is_probed_again():
    Product = _scaled_product(3.0)
    x, w = torch.randn(4, dtype=F64), torch.randn(4, dtype=F64)
    with forward_ad.dual_level():
        only_x = _probes.verdict(Product, Product.apply, _duals((x, torch.ones_like(x)), (w, None)), {}, with_jvp=True)
        both = _probes.verdict(Product, Product.apply, _duals((x, torch.ones_like(x)), (w, torch.ones_like(w))), {},
                               with_jvp=True)
        again = _probes.verdict(Product, lambda *a: 1 / 0, _duals((x, torch.ones_like(x)), (w, None)), {},
                                with_jvp=True)  # remembered: not run again
        x32, w32 = x.float(), w.float()
        in_float32 = _probes.verdict(Product, Product.apply, _duals((x32, torch.ones_like(x32)), (w32, None)), {},
                                     with_jvp=True)
    assert only_x.jvp_agrees and again is only_x and in_float32 is not only_x and in_float32.jvp_agrees
    assert not both.jvp_agrees and both.numbers[0] != both.numbers[1]


def test_a_function_whose_jvp_is_wrong_for_one_argument_is_caught_when_that_argument_carries_a_tangent():
    Product = _scaled_product(3.0)
    W = torch.randn(4, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    c = torch.randn(4, dtype=F64)
    f = lambda y, g: ((y + g) ** 3).sum()  # noqa: E731
    z, y, v = (torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    only_x = lambda q: Product.apply(torch.tanh(q @ W), c)  # noqa: E731  the jvp is right here
    both = lambda q: Product.apply(torch.tanh(q @ W), torch.sin(q))  # noqa: E731  and wrong here
    assert_close(mixedad.mixed_grad(f, only_x, z, y, v), mixedad.reference.double_backward_mixed_grad(f, only_x, z, y, v),
                 rtol=1e-10)
    with pytest.warns(RuntimeWarning, match=r"Product.jvp disagrees with the backward"):
        ours = mixedad.mixed_grad(f, both, z, y, v)
    assert_close(ours, mixedad.reference.double_backward_mixed_grad(f, both, z, y, v), rtol=1e-10)


def test_a_rule_that_declines_the_probe_is_not_remembered_as_checked():
    x = torch.randn(3, dtype=F64)

    def declines(*args, **kwargs):
        return NotImplemented

    with forward_ad.dual_level():
        found = _probes.verdict(declines, torch.sin, _duals((x, torch.ones_like(x))), {}, with_jvp=True, jvp=declines,
                                op=torch.sin)
    assert found.jvp_agrees and not found.jvp_tested  # probed again on the next call


def test_probes_leave_every_random_source_as_they_were():
    gen = torch.Generator().manual_seed(3)

    class Noisy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * (1 + torch.rand(x.shape, generator=gen, dtype=x.dtype) + random.random() + torch.rand(()))

        @staticmethod
        def backward(ctx, g):
            return g

    x = torch.randn(3, dtype=F64)
    before = (torch.get_rng_state(), random.getstate(), gen.get_state())
    with forward_ad.dual_level():
        _probes.verdict(Noisy, Noisy.apply, _duals((x, torch.ones_like(x))), {}, with_jvp=False)
    after = (torch.get_rng_state(), random.getstate(), gen.get_state())
    assert torch.equal(before[0], after[0]) and before[1] == after[1] and torch.equal(before[2], after[2])


def test_a_plan_counts_the_probe_of_a_first_call_exactly():
    class SinNoJvp(SinWithoutJvp):  # a class of its own: no verdict for it from other tests
        pass

    weights = [torch.randn(64, 64, generator=torch.Generator().manual_seed(i)) / 8 for i in range(3)]

    def G(z):
        for w in weights:
            z = SinNoJvp.apply(z @ w)
        return z

    f = lambda y, g: ((y - g) ** 2).sum()  # noqa: E731
    z, y = torch.randn(128, 64), torch.randn(128, 64)
    planned = mixedad.profiling.plan(f, G, z, y, methods=("mixed_grad",), device="cpu").peaks["mixed_grad"]
    _, first = mixedad.profiling.peak_memory(lambda: mixedad.mixed_grad(f, G, z, y))
    _, later = mixedad.profiling.peak_memory(lambda: mixedad.mixed_grad(f, G, z, y))
    assert planned == first > later  # the first call probes the Function; a plan is never below it
