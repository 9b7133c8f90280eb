"""Ops without forward-AD formulas, lost tangents and compiled generators: never a silent wrong answer."""
import pytest
import torch
from torch import nn
from torch.autograd import forward_ad

import mixedad
from mixedad import zoo
from mixedad.reference import double_backward_input_grad, double_backward_mixed_grad
from mixedad.testing import assert_close

from tests.op_rule_generators import SinWithoutJvp

F64 = torch.float64


class Apply(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def with_custom_op():
    return nn.Sequential(nn.Linear(6, 6), Apply(SinWithoutJvp.apply), nn.Linear(6, 6)).to(F64)


def f(y, g):
    return ((y + g) ** 3).sum()


def data(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(4, 6, generator=gen, dtype=F64) for _ in range(3))


@pytest.mark.parametrize("strategy", ["auto", "forward"])
def test_custom_function_without_jvp_takes_the_local_rule_silently(strategy):
    """No whole-G fallback and no warning: the local rule is exact and flat (warnings are errors here)."""
    G = with_custom_op()
    z, y, v = data()
    result = mixedad.mixed_grad(f, G, z, y, v, strategy=strategy)
    assert_close(result, double_backward_mixed_grad(f, G, z, y, v))


@pytest.mark.parametrize("name", ["mlp", "transformer_sdpa", "stylegan"])
def test_strategy_reverse_matches_without_warning(name):
    G = zoo.MEMBERS[name](dtype=F64)
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(zoo.latent_shape(G, 2), generator=gen, dtype=F64)
    y = torch.randn(G(z).shape, generator=gen, dtype=F64)
    v = torch.randn(z.shape, generator=gen, dtype=F64)
    assert_close(mixedad.mixed_grad(f, G, z, y, v, strategy="reverse"), double_backward_mixed_grad(f, G, z, y, v))


def test_local_rule_in_train_mode_sees_the_state_of_one_plain_forward():
    """Dropout masks and BatchNorm statistics with a custom op on the local rule: as one plain forward."""
    G = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.3), Apply(SinWithoutJvp.apply),
                      nn.Linear(6, 6)).to(F64).train()
    plain = __import__("copy").deepcopy(G)
    ref_G = __import__("copy").deepcopy(G)
    z, y, v = data()
    torch.manual_seed(3)
    ours = mixedad.mixed_grad(f, G, z, y, v)
    rng = torch.get_rng_state()
    torch.manual_seed(3)
    expected = double_backward_mixed_grad(f, ref_G, z, y, v)
    torch.manual_seed(3)
    with torch.no_grad():
        plain(z)
    assert_close(ours, expected)
    assert torch.equal(rng, torch.get_rng_state())
    assert torch.equal(G[1].running_mean, plain[1].running_mean)
    assert int(G[1].num_batches_tracked) == 1


def test_input_grad_backward_takes_the_local_rule_too():
    G = with_custom_op()
    z, y, _ = data()
    y = y[0]  # shared by every latent code
    x = torch.randn(6, 2, dtype=F64)

    def run(make):
        y_ = y.clone().requires_grad_()
        (make(f, G, z, y_, chunk_size=2) @ x).pow(2).sum().backward()
        return y_.grad

    assert_close(run(mixedad.input_grad), run(double_backward_input_grad))


def drops_tangent():
    """A G whose middle drops forward-mode tangents but keeps reverse mode, as a buggy compiler might."""
    mlp = zoo.mlp(3, 6, seed=4, dtype=F64)
    return lambda z: mlp(forward_ad.unpack_dual(torch.tanh(z)).primal)


def test_lost_tangent_is_detected_and_recomputed():
    G = drops_tangent()
    z, y, v = data()
    with pytest.warns(RuntimeWarning, match="lost its forward-mode tangent"):
        result = mixedad.mixed_grad(f, G, z, y, v)
    assert_close(result, double_backward_mixed_grad(f, G, z, y, v))


def test_lost_tangent_with_strategy_forward_raises():
    z, y, v = data()
    G = drops_tangent()
    with pytest.raises(RuntimeError, match=r"G\(z\) came back without a forward-mode tangent"):
        mixedad.mixed_grad(f, G, z, y, v, strategy="forward")


def test_output_independent_of_z_is_zero_without_warning():
    """A None tangent that really means 'independent of z' is confirmed and gives exact zeros."""
    z, y, v = data()
    constant = torch.randn(4, 6, dtype=F64)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = mixedad.mixed_grad(f, lambda z: constant * 1.0, z, y, v)
    assert torch.equal(result, torch.zeros_like(y))


def test_compiled_generator_uses_its_eager_module():
    G = zoo.mlp(3, 6, seed=5, dtype=F64)
    compiled = torch.compile(G, backend="eager")
    z, y, v = data()
    with pytest.warns(RuntimeWarning, match="compiled with torch.compile"):
        result = mixedad.mixed_grad(f, compiled, z, y, v)
    assert_close(result, double_backward_mixed_grad(f, G, z, y, v))


def test_transformer_fast_path_flag_restored():
    if not hasattr(torch.backends, "mha"):
        pytest.skip("torch without torch.backends.mha")
    G = zoo.MEMBERS["transformer_layer"](dtype=F64)
    z = torch.randn(zoo.latent_shape(G, 2), dtype=F64)
    before = torch.backends.mha.get_fastpath_enabled()
    mixedad.mixed_grad(f, G, z, torch.randn(2, 4, 8, dtype=F64))
    assert torch.backends.mha.get_fastpath_enabled() == before


def test_train_mode_batchnorm_under_mixed_jacobian_and_vmap():
    """vmap cannot update buffers: mixed_jacobian takes one pass per tangent, a user's vmap is told why."""
    from mixedad.reference import double_backward_mixed_jacobian

    G = zoo.MEMBERS["dcgan"](dtype=F64).train()
    z = torch.randn(zoo.latent_shape(G, 1), dtype=F64)
    y = torch.randn(1, 3, 8, 8, dtype=F64)
    stats = [b.clone() for b in G.buffers()]
    jac = mixedad.mixed_jacobian(f, G, z, y, chunk_size=7)
    after = [b.clone() for b in G.buffers()]
    for b, s in zip(G.buffers(), stats):
        b.copy_(s)
    assert_close(jac, double_backward_mixed_jacobian(f, G, z, y), rtol=1e-10)
    for b, s in zip(G.buffers(), stats):
        b.copy_(s)
    with torch.no_grad():
        G(z)  # one plain train-mode forward
    assert all(torch.equal(a, b) for a, b in zip(after, G.buffers()))
    vs = torch.randn(2, *z.shape, dtype=F64)
    with pytest.raises(RuntimeError, match=r"mixed_grad\(f, G, z, y\): G writes in place into a tensor from outside .*Call "
                                           r"mixed_grad once per tangent"):
        torch.func.vmap(lambda v: mixedad.mixed_grad(f, G, z, y, v))(vs)


def test_mixed_jacobian_with_dropout_uses_one_mask_for_all_rows():
    G = zoo.mlp(3, 4, dropout=0.5, seed=6, dtype=F64).train()
    z, y = torch.randn(2, 4, dtype=F64), torch.randn(2, 4, dtype=F64)
    torch.manual_seed(9)
    jac = mixedad.mixed_jacobian(f, G, z, y, chunk_size=3)
    rng = torch.get_rng_state()
    v = torch.randn_like(z)
    torch.manual_seed(9)
    assert_close(torch.tensordot(v, jac, dims=2), double_backward_mixed_grad(f, G, z, y, v))
    assert torch.equal(rng, torch.get_rng_state())


def test_bad_strategy():
    z, y, v = data()
    for fn in (mixedad.mixed_grad, mixedad.input_grad, mixedad.mixed_jacobian):
        with pytest.raises(ValueError, match=r"expected strategy in \('auto', 'forward', 'reverse'\), got 'fast'"):
            fn(f, with_custom_op(), z, y, strategy="fast")


def test_check_generator_passes_on_the_zoo_and_catches_partial_loss():
    from mixedad.testing import check_generator

    for name, build in zoo.MEMBERS.items():
        G = build(dtype=F64)
        assert check_generator(G, torch.randn(zoo.latent_shape(G, 2), dtype=F64)) < 1e-10, name
    mlp = zoo.mlp(3, 6, seed=4, dtype=F64)

    def partly_lossy(z):  # part of the tangent survives, so no call can notice the loss
        return mlp(forward_ad.unpack_dual(torch.tanh(z)).primal) + 0.5 * z

    z = torch.randn(4, 6, dtype=F64)
    with pytest.raises(AssertionError, match=r"check_generator\(G, z\): <u, J v> by mixedad's tangents .* strategy='reverse'"):
        check_generator(partly_lossy, z)
    assert check_generator(partly_lossy, z, strategy="reverse") < 1e-10


def test_inside_callers_dual_level_auto_falls_back_to_reverse():
    """PyTorch cannot nest forward mode: inside the caller's dual_level mixedad goes reverse."""
    G = zoo.mlp(3, 6, seed=5, dtype=F64)
    z, y, v = data()
    x = torch.randn(4, 6, dtype=F64)
    y_naive = y[0].clone().requires_grad_()  # one y shared by every code, for input_grad
    (double_backward_input_grad(f, G, z, y_naive) * x).sum().backward()
    with forward_ad.dual_level():
        with pytest.warns(RuntimeWarning, match="inside an open forward_ad.dual_level"):
            ours = mixedad.mixed_grad(f, G, z, y, v)
        y_ours = y[0].clone().requires_grad_()
        (mixedad.input_grad(f, G, z, y_ours, chunk_size=3) * x).sum().backward()
        with pytest.raises(RuntimeError, match="cannot nest forward-mode AD.*strategy='forward' forbids it"):
            mixedad.mixed_grad(f, G, z, y, v, strategy="forward")
    assert_close(ours, double_backward_mixed_grad(f, G, z, y, v))
    assert_close(y_ours.grad, y_naive.grad)


@pytest.mark.parametrize("which", ["z", "y", "v"])
def test_callers_dual_inputs_are_refused_not_dropped(which):
    G = zoo.mlp(2, 6, seed=5, dtype=F64)
    z, y, v = data()
    with forward_ad.dual_level():
        args = {"z": z, "y": y, "v": v}
        args[which] = forward_ad.make_dual(args[which], torch.ones_like(args[which]))
        with pytest.raises(ValueError, match="forward-mode dual tensor of the caller's dual_level"):
            mixedad.mixed_grad(f, G, args["z"], args["y"], args["v"])
        if which != "v":
            with pytest.raises(ValueError, match="forward-mode dual tensor of the caller's dual_level"):
                mixedad.input_grad(f, G, args["z"], args["y"])


def test_jvp_over_mixed_grad_is_not_taken_for_a_callers_dual_level():
    """torch.func.jvp opens a dual level too; mixedad composes with it as before, silently."""
    import warnings

    G = zoo.mlp(2, 6, seed=5, dtype=F64)
    z, y, v = data()
    dy = torch.randn_like(y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, ours = torch.func.jvp(lambda yy: mixedad.mixed_grad(f, G, z, yy, v, create_graph=True), (y,), (dy,))
    eps = 1e-6  # central differences of the reference in y (it cannot run under torch.func)
    expected = (double_backward_mixed_grad(f, G, z, y + eps * dy, v)
                - double_backward_mixed_grad(f, G, z, y - eps * dy, v)) / (2 * eps)
    assert_close(ours, expected, rtol=1e-7)
