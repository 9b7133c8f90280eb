"""Generators that PyTorch's forward mode cannot pass: exact, flat in depth, far below double backward.

Each takes its awkward ops on a per-op rule (the local double-VJP rule or a written formula),
never on the whole-G fallback: strategy="forward" would raise if it did.
"""
import pytest
import torch

import mixedad
from mixedad.profiling import peak_memory
from mixedad.reference import double_backward_mixed_grad, finite_difference_mixed_grad
from mixedad.testing import assert_close

from tests.op_rule_generators import NAMES, build, cubic

F64, F32 = torch.float64, torch.float32

# What each generator must show in the report: the op that forward mode cannot take, and its path.
AWKWARD = {
    "stylegan2_ada": ("_BiasAct (custom Function)", "local double-VJP"),
    "vq_decoder": ("torch.functional.cdist", "written formula"),
    "group_norm_channels_last": ("torch.nn.functional.group_norm", "written formula"),
    "grid_sample_warp": ("torch.nn.functional.grid_sample", "local double-VJP"),
    "lstm": ("torch.lstm", "local double-VJP"),
}


@pytest.fixture(autouse=True)
def fresh_failures():
    mixedad.op_rules.forget_failures()
    yield
    mixedad.op_rules.forget_failures()


@pytest.mark.parametrize("name", NAMES)
def test_exact_against_double_backward_in_float64(name):
    G, z, y, v = build(name, 3, F64)
    ours = mixedad.mixed_grad(cubic, G, z, y, v, strategy="forward")
    assert_close(ours, double_backward_mixed_grad(cubic, G, z, y, v))


@pytest.mark.parametrize("name", NAMES)
def test_awkward_op_takes_its_per_op_rule(name):
    """float32, where the LSTM runs mkldnn_rnn_layer (no formula); float64 takes PyTorch's formula."""
    G, z, _, v = build(name, 2, F32)
    report = mixedad.tangent_report(G, z, v, strategy="forward")
    op, path = AWKWARD[name]
    assert op in report.ops(path), str(report)
    assert report.flat


@pytest.mark.parametrize("name", ["stylegan2_ada", "grid_sample_warp"])
def test_agrees_with_finite_differences(name):
    """An independent check of the reference itself, on generators smooth enough for differences."""
    G, z, y, v = build(name, 1, F64)
    assert_close(mixedad.mixed_grad(cubic, G, z, y, v), finite_difference_mixed_grad(cubic, G, z, y, v),
                 rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_peak_flat_in_depth_and_below_double_backward(name):
    """float32 (the LSTM's local-rule path); exact byte counts. Depth 4 against depth 32."""
    _, peak_4 = peak_memory(mixedad.mixed_grad, cubic, *build(name, 4, F32), strategy="forward")
    ours, peak_32 = peak_memory(mixedad.mixed_grad, cubic, *build(name, 32, F32), strategy="forward")
    expected, reference_32 = peak_memory(double_backward_mixed_grad, cubic, *build(name, 32, F32))
    _, reference_4 = peak_memory(double_backward_mixed_grad, cubic, *build(name, 4, F32))
    assert_close(ours, expected, rtol=1e-4)
    assert abs(peak_32 - peak_4) <= 0.10 * peak_4, (peak_4, peak_32)
    assert peak_32 <= 0.15 * reference_32, (peak_32, reference_32)
    assert reference_32 > 3 * reference_4  # double backward's peak does grow with depth


def test_input_grad_through_custom_functions_is_exact():
    from mixedad.reference import double_backward_input_grad

    G, z, y, _ = build("stylegan2_ada", 2, F64)
    w = torch.randn(z.shape, dtype=F64)

    def run(make):
        y_ = y[:1].clone().requires_grad_()
        (make(cubic, G, z, y_, chunk_size=1) * w).sum().backward()
        return y_.grad

    assert_close(run(mixedad.input_grad), run(double_backward_input_grad))
