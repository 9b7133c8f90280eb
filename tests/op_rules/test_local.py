"""The local rule's failure memory: told apart by the exception's type, never its text."""
import pytest
import torch

from mixedad.op_rules import _local

F64 = torch.float64


@pytest.fixture(autouse=True)
def fresh():
    _local.forget_failures()
    yield
    _local.forget_failures()


def test_a_missing_formula_is_remembered_per_dtype_and_device_whatever_its_message():
    x = torch.randn(3, dtype=F64)
    _local.remember_failure(torch.sin, (x,), {}, NotImplementedError("any words at all"))
    other_shape = torch.randn(5, 2, dtype=F64)
    assert _local.failed_rule(torch.sin, (other_shape,), {}) is not None
    assert _local.failed_rule(torch.sin, (other_shape.float(),), {}) is None


def test_another_failure_is_remembered_per_input_signature_even_if_its_message_says_no_formula():
    x = torch.randn(3, dtype=F64)
    _local.remember_failure(torch.sin, (x,), {}, RuntimeError("Trying to use forward AD with sin that does not support it"))
    assert _local.failed_rule(torch.sin, (torch.randn(3, dtype=F64),), {}) is not None
    assert _local.failed_rule(torch.sin, (torch.randn(4, dtype=F64),), {}) is None


def test_local_jvp_is_exact_on_one_op_and_declines_without_tangents():
    x, t = torch.randn(3, dtype=F64), torch.randn(3, dtype=F64)
    assert _local.local_jvp("call", "sin", torch.sin, (x,), {}) is NotImplemented
    with torch.autograd.forward_ad.dual_level():
        out = _local.local_jvp("call", "sin", torch.sin, (torch.autograd.forward_ad.make_dual(x, t),), {})
        tangent = torch.autograd.forward_ad.unpack_dual(out).tangent
    assert torch.allclose(tangent, x.cos() * t)


def test_local_jvp_in_a_batch_of_tangents_runs_the_op_once():
    from mixedad._hooks.functorch import TangentBatch

    calls = []

    def sin_counted(x):
        calls.append(1)
        return x.sin()

    batch = TangentBatch()
    z, vs = torch.randn(3, dtype=F64), torch.randn(4, 3, dtype=F64)
    out, out_tangents = batch.push(lambda x: (_local.local_jvp("call", "sin", sin_counted, (x,), {}, batch=batch),),
                                   [z], [vs])
    assert calls == [1]
    assert torch.allclose(out[0], z.sin()) and torch.allclose(out_tangents[0], vs * z.cos(), rtol=1e-13)


def test_failures_are_remembered_per_device_and_dtype():
    """A CPU run's failures must not send a plan on meta (or another dtype) to the local rule."""
    x = torch.randn(3, dtype=F64)
    _local.remember_failure(torch.sin, (x,), {}, NotImplementedError("no formula"))
    _local.remember_failure(torch.cos, (x,), {}, RuntimeError("raised"))
    for func in (torch.sin, torch.cos):
        assert _local.failed_rule(func, (x,), {}) is not None
        assert _local.failed_rule(func, (torch.empty(3, dtype=F64, device="meta"),), {}) is None
        assert _local.failed_rule(func, (x.float(),), {}) is None
