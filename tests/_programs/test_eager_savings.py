"""The default's programs (run without a compiler) save passes and tensors: an eval batch norm's scale runs in the
tangent convolution's weight before it (the primal stays G's own calls), and activations whose tangent reads their
output alone run in place on tensors of the program's own (its input, its incoming tangent). Each saving is checked against double backward, against a plain forward,
and for what it must leave alone: G's buffers and the caller's tensors."""
import copy

import pytest
import torch
from torch import nn

import mixedad
from mixedad._programs import cache
from mixedad._programs import functions as T
from mixedad.reference import double_backward_mixed_grad
from tests._programs.common import D, f


def _program_calls(G, z, y, v):
    """Three calls of the default (per-op pass, check, program alone), each against double backward; the entry."""
    twin = copy.deepcopy(G)
    for call in range(3):
        reference = double_backward_mixed_grad(f, copy.deepcopy(twin), z, y, v)
        ours = mixedad.mixed_grad(f, G, z, y, v)
        with torch.no_grad():
            twin(z)
        assert (ours - reference).abs().max() <= 1e-9 * reference.abs().max(), f"call {call + 1}"
        for (key, mine), theirs in zip(G.state_dict().items(), twin.state_dict().values()):
            assert torch.equal(mine, theirs), f"call {call + 1}: buffer {key}"
    [entry] = cache._EAGER[G].values()
    assert entry.status == "program", entry.reason
    return entry


def _targets(entry):
    return [getattr(n.target, "__name__", str(n.target)) for n in entry.program.module.graph.nodes]


def _inputs(G, shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, dtype=D, generator=gen)
    with torch.no_grad():
        out = G(z)
    return z, torch.randn(out.shape, dtype=D, generator=gen), torch.randn(shape, dtype=D, generator=gen)


@pytest.mark.parametrize("bias, affine", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("conv", [nn.Conv2d, nn.ConvTranspose2d, nn.Conv1d])
def test_an_eval_batch_norm_folds_into_the_tangent_convolution_and_the_primal_is_a_plain_forwards(conv, bias, affine):
    """``conv(t, W) s = conv(t, W s)``: one convolution of the tangent, no scaling pass; the primal is G's own calls,
    a plain forward's bit for bit (so every ReLU kink falls as in double backward)."""
    torch.manual_seed(0)
    two_d = conv is not nn.Conv1d
    norm = nn.BatchNorm2d(6, affine=affine) if two_d else nn.BatchNorm1d(6, affine=affine)
    G = nn.Sequential(conv(3, 6, 3, padding=1, bias=bias), norm, nn.ReLU(), conv(6, 6, 3, padding=1),
                      nn.BatchNorm2d(6) if two_d else nn.BatchNorm1d(6), nn.Tanh()).to(D)
    with torch.no_grad():  # running statistics and affine parameters away from their initial 0 and 1
        for m in G:
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                if m.affine:
                    m.weight.uniform_(0.5, 2)
                    m.bias.uniform_(-1, 1)
    G.eval().requires_grad_(False)
    z, y, v = _inputs(G, (8, 3, 5, 5) if two_d else (8, 3, 5))
    entry = _program_calls(G, z, y, v)
    assert _targets(entry).count("conv_batch_norm_eval") == 2
    with torch.no_grad():
        (primal,), _ = entry.run(z, v)
        plain = G(z)
    assert torch.equal(primal, plain)


def test_a_weight_larger_than_the_tangent_scales_the_tangent_after_its_convolution():
    """A small batch, where the scaled weight would be the larger copy: the tangent's convolution, then the scale;
    a larger batch folds the scale into the weight. The same tangent either way, to round-off."""
    from mixedad.op_rules._frozen_layers import folded_weight

    torch.manual_seed(0)
    conv, bn = nn.Conv2d(4, 4, 3).to(D), nn.BatchNorm2d(4).to(D).eval()
    with torch.no_grad():
        bn.running_var.uniform_(0.5, 2)
    for batch, expected_fold in [(1, False), (16, True)]:  # weight 144 numbers, FOLD_RATIO 16: a tangent of 2304
        x, t = torch.randn(batch, 4, 6, 6, dtype=D), torch.randn(batch, 4, 6, 6, dtype=D)
        with torch.no_grad():
            tangent = T.conv_batch_norm_eval(conv, bn, t)
            expected = torch.func.jvp(lambda x_: bn(conv(x_)), (x,), (t,))[1]
        assert (folded_weight(conv, bn, t) is not None) == expected_fold
        assert (tangent - expected).abs().max() <= 1e-13 * expected.abs().max()


@pytest.mark.parametrize("activation, in_place", [
    (nn.ReLU(), True), (nn.Tanh(), True), (nn.Sigmoid(), True), (nn.LeakyReLU(0.1), True),
    (nn.LeakyReLU(-0.5), False),  # the tangent reads the input where the slope is negative
    (nn.GELU(), False), (nn.SiLU(), False), (nn.Hardtanh(), False)])
def test_an_activation_runs_in_place_only_where_its_tangent_reads_the_output_alone(activation, in_place):
    G = nn.Sequential(nn.Linear(4, 6), activation, nn.Linear(6, 3), copy.deepcopy(activation)).to(D)
    G.requires_grad_(False)
    z, y, v = _inputs(G, (5, 4))
    entry = _program_calls(G, z, y, v)
    targets = _targets(entry)
    assert sum(t.endswith("_tangent_in_place") for t in targets) == (2 if in_place else 0)
    assert sum(t.endswith("_in_place") for t in targets) == (4 if in_place else 0)
    with torch.no_grad():
        (primal,), _ = entry.run(z, v)
        assert torch.equal(primal, G(z))  # the same kernels in place: the same numbers


@pytest.mark.parametrize("front", [[], [nn.Identity()], [nn.Flatten()], [nn.Unflatten(1, (2, 2)), nn.Flatten()],
                                   [nn.Dropout(0.0)]])
def test_an_activation_never_writes_into_the_callers_tensors(front):
    """The activation's input is z itself or a view of it, its tangent v or a view of it: both computed out of
    place, z and v left as they were."""
    G = nn.Sequential(*front, nn.ReLU(), nn.Linear(4, 3), nn.Tanh()).to(D).eval().requires_grad_(False)
    z, y, v = _inputs(G, (5, 4))
    z_before, v_before = z.clone(), v.clone()
    versions = z._version, v._version
    entry = _program_calls(G, z, y, v)
    targets = _targets(entry)
    assert "relu_in_place" not in targets and "relu_tangent_in_place" not in targets
    assert "tanh_in_place" in targets and "tanh_tangent_in_place" in targets  # after the Linear: its own tensors
    assert torch.equal(z, z_before) and torch.equal(v, v_before) and (z._version, v._version) == versions


def test_train_mode_batch_norm_output_is_overwritten_by_the_activation_and_running_statistics_stay_exact():
    G = mixedad.zoo.dcgan(2, 8, dtype=D).train().requires_grad_(False)
    z, y, v = _inputs(G, mixedad.zoo.latent_shape(G, 4))
    entry = _program_calls(G, z, y, v)  # buffers against plain forwards, bit for bit
    targets = _targets(entry)
    assert "relu_in_place" in targets and "relu_tangent_in_place" in targets


def test_the_savings_lower_the_programs_peak_at_the_benchmarks_size_and_keep_it_flat_in_depth():
    """Exact bytes, the speed benchmark's eval DCGAN (width 32, batch 32, float32): the program's peak lies below the
    per-op pass's, and is the same at 0 and 4 extra blocks a scale. A scaled weight held beside the primal's input
    and both outputs of a layer (a primal and tangent computed in one call) put it above the per-op pass's."""
    from mixedad.benchmark import build, objective
    from mixedad.profiling import peak_memory

    peaks = []
    for depth in (0, 4):
        G, z, y, v = build("dcgan", depth, 32, 32, torch.float32, "cpu")
        G.eval().requires_grad_(False)
        with mixedad.programs.per_op_pass():
            _, per_op = peak_memory(lambda: mixedad.mixed_grad(objective, G, z, y, v))
        for _ in range(2):
            mixedad.mixed_grad(objective, G, z, y, v)
        _, program = peak_memory(lambda: mixedad.mixed_grad(objective, G, z, y, v))
        assert program < per_op, (depth, program, per_op)
        peaks.append(program)
    assert peaks[0] == peaks[1], peaks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_check_sees_a_dropped_or_scaled_tangent_in_every_dtype(dtype):
    """A thousand epsilons of bfloat16 are 8 times a tensor's size: the check's round-off floor is capped, so that
    a dropped tangent (difference 1) or a wrong scale is never taken for round-off."""
    gen = torch.Generator().manual_seed(0)
    eager, inputs = torch.randn(100, generator=gen).to(dtype), torch.randn(10, generator=gen).to(dtype)
    assert cache._differs([torch.zeros_like(eager)], [eager], [inputs]) == 1.0
    assert cache._differs([eager * 1.5], [eager], [inputs]) == pytest.approx(0.5, abs=1e-2)
    assert cache._differs([eager], [eager], [inputs]) == 0.0
    tiny = eager * 1e-6  # zero in exact arithmetic, computed: round-off either way
    assert cache._differs([tiny], [-tiny], [inputs]) == 0.0
    # The eager pass's exact zero against a program's round-off of it (a bfloat16 batch norm over the batch with a
    # large scale): round-off, up to the uncapped floor; the reverse, a program's zero against a tangent, never.
    noise = eager * 5e-2
    against_zero = cache._differs([noise], [torch.zeros_like(eager)], [inputs])
    assert against_zero > 1 if dtype == torch.float32 else against_zero == 0.0  # float32: 5e-2 is no round-off
    assert cache._differs([torch.zeros_like(eager)], [noise], [inputs]) == 1.0


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_reduced_precision_chain_takes_its_program_within_the_round_off_of_its_dtype(dtype):
    G = mixedad.zoo.dcgan(8, 8).eval().requires_grad_(False)
    reference_G = copy.deepcopy(G).to(D)
    G = G.to(dtype)
    gen = torch.Generator().manual_seed(0)
    z, y, v = (torch.randn(shape, generator=gen) for shape in [(16, 8), (16, 3, 32, 32), (16, 8)])
    reference = double_backward_mixed_grad(f, reference_G, z.to(D), y.to(D), v.to(D))
    for call in range(3):
        ours = mixedad.mixed_grad(f, G, z.to(dtype), y.to(dtype), v.to(dtype))
        assert ((ours.to(D) - reference).norm() / reference.norm()).item() < 0.15, call
    [entry] = cache._EAGER[G].values()
    assert entry.status == "program" and entry.difference < cache._EAGER_REDUCED, entry
    assert "conv_batch_norm_eval" in _targets(entry)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_tangent_zero_in_exact_arithmetic_in_bfloat16_keeps_its_program():
    """v of ones through a train-mode batch norm over the batch: zero in exact arithmetic. The per-op pass gives
    exact zeros, the program round-off of them (a large scale: inputs of size 0.1); the check takes it for round-off
    (a review found the capped floor dropping the program with a warning)."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(20, 32), nn.BatchNorm1d(32)).to(torch.bfloat16).requires_grad_(False)
    z, y = (torch.randn(16, 20) * 0.1).to(torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    for _ in range(3):
        mixedad.mixed_grad(lambda y, g: (y * g).sum(), G, z, y)
    [entry] = cache._EAGER[G].values()
    assert entry.status == "program", entry.reason


def test_an_eval_batch_norm_before_a_train_mode_one_keeps_its_primal_and_the_running_statistics_exact():
    """A later train-mode batch norm updates its running statistics from the primal: the program's primal is G's own
    calls, so they stay a plain forward's bit for bit (a review found them 1e-17 off in float64, growing, when the
    primal was folded)."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1),
                      nn.BatchNorm2d(4)).to(D).requires_grad_(False)
    with torch.no_grad():
        G[1].running_mean.uniform_(-1, 1)
        G[1].running_var.uniform_(0.5, 2)
    G[1].eval()
    z, y, v = _inputs(G, (16, 3, 8, 8))
    twin = copy.deepcopy(G)  # after _inputs' forward, which ran under no_grad on G alone
    entry = None
    for call in range(6):
        reference = double_backward_mixed_grad(f, copy.deepcopy(twin), z, y, v)
        ours = mixedad.mixed_grad(f, G, z, y, v)
        with torch.no_grad():
            twin(z)
        assert (ours - reference).abs().max() <= 1e-9 * reference.abs().max(), call
        for (key, mine), theirs in zip(G.state_dict().items(), twin.state_dict().values()):
            assert torch.equal(mine, theirs), f"call {call + 1}: buffer {key}"
    [entry] = cache._EAGER[G].values()
    assert entry.status == "program"
    assert "conv_batch_norm_eval" in _targets(entry) and "relu_in_place" in _targets(entry)
