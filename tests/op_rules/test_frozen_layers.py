"""The fast frozen-layer rules agree with PyTorch's general forward AD, layer by layer."""
import pytest
import torch
from torch import nn
import torch.nn.functional as F

from mixedad.op_rules import OpRules
from mixedad._frontend.tangents import _forward
from mixedad.testing import assert_close

F64 = torch.float64

LAYERS = {
    "linear": (lambda: nn.Linear(6, 5), (4, 6)),
    "linear_no_bias_3d_input": (lambda: nn.Linear(6, 5, bias=False), (2, 3, 6)),
    "conv1d_stride_dilation": (lambda: nn.Conv1d(3, 4, 3, stride=2, dilation=2, padding=1), (2, 3, 11)),
    "conv2d_groups": (lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), (2, 4, 5, 5)),
    "conv2d_reflect_padding": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (2, 3, 5, 5)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2), (1, 2, 4, 4, 4)),
    "conv_transpose1d": (lambda: nn.ConvTranspose1d(3, 2, 4, stride=2, padding=1), (2, 3, 7)),
    "conv_transpose2d_output_padding": (lambda: nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1), (2, 3, 4, 4)),
    "conv_transpose2d_no_bias": (lambda: nn.ConvTranspose2d(3, 2, 4, 2, 1, bias=False), (2, 3, 4, 4)),
    "batchnorm1d_eval": (lambda: nn.BatchNorm1d(5).eval(), (4, 5)),
    "batchnorm2d_eval_no_affine": (lambda: nn.BatchNorm2d(3, affine=False).eval(), (2, 3, 4, 4)),
    "batchnorm2d_train": (lambda: nn.BatchNorm2d(3).train(), (4, 3, 4, 4)),
    "batchnorm2d_no_running_stats": (lambda: nn.BatchNorm2d(3, track_running_stats=False).eval(), (4, 3, 4, 4)),
    "batchnorm1d_train": (lambda: nn.BatchNorm1d(5).train(), (6, 5)),
    "batchnorm1d_train_sequence": (lambda: nn.BatchNorm1d(3).train(), (4, 3, 7)),
    "batchnorm3d_train": (lambda: nn.BatchNorm3d(2).train(), (3, 2, 3, 4, 4)),
    "batchnorm2d_train_channels_last": (lambda: ChannelsLast(nn.BatchNorm2d(3).train()), (4, 3, 4, 4)),
    "batchnorm2d_train_far_mean": (lambda: Offset(nn.BatchNorm2d(3).train(), 1e3), (4, 3, 4, 4)),
    "functional_kwargs": (lambda: FunctionalKwargs(), (2, 3, 6, 6)),
}


class ChannelsLast(nn.Sequential):
    """A layer fed channels-last input (and so channels-last tangents)."""

    def forward(self, x):
        return super().forward(x.contiguous(memory_format=torch.channels_last))


class Offset(nn.Sequential):
    """A layer fed input whose mean lies far from zero against its spread."""

    def __init__(self, layer, offset):
        super().__init__(layer)
        self.offset = offset

    def forward(self, x):
        return super().forward(x + self.offset)


class FunctionalKwargs(nn.Module):
    """Calls with keyword arguments, the way some hand-written generators do."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, 3, 3))
        self.b = nn.Parameter(torch.randn(4))
        self.register_buffer("mean", torch.randn(4))
        self.register_buffer("var", torch.rand(4) + 0.5)

    def forward(self, x):
        h = torch.nn.functional.conv2d(x, weight=self.w, bias=self.b, padding=1)
        return torch.nn.functional.batch_norm(h, self.mean, self.var, weight=None, bias=self.b, training=False, eps=1e-3)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_fast_rules_match_general_forward_ad(name):
    build, shape = LAYERS[name]
    torch.manual_seed(0)
    layer = build().to(F64)
    for m in layer.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    x, t = torch.randn(shape, dtype=F64), torch.randn(shape, dtype=F64)
    fast = _forward("test", layer, (x,), (t,), OpRules("test"))
    layer.load_state_dict(state)
    general = _forward("test", layer, (x,), (t,), None)
    assert_close(fast[0], general[0], rtol=1e-12)
    assert_close(fast[1], general[1], rtol=1e-12)
    assert fast[1][0].abs().max() > 0


def test_weights_with_tangents_take_general_forward_ad():
    """A weight that depends on z (a modulated convolution) must keep its tangent contribution."""
    from torch.autograd import forward_ad

    base = torch.randn(4, 3, 3, 3, dtype=F64)

    def G(z):  # the weight is a function of z, so it carries a tangent
        return torch.nn.functional.conv2d(torch.ones(1, 3, 5, 5, dtype=F64), base * z.sum(), padding=1)

    z, v = torch.randn(2, dtype=F64), torch.randn(2, dtype=F64)
    fast = _forward("test", G, (z,), (v,), OpRules("test"))
    with forward_ad.dual_level():
        expected = forward_ad.unpack_dual(G(forward_ad.make_dual(z, v))).tangent
    assert_close(fast[1][0], expected)


@pytest.fixture
def onednn_spy(monkeypatch):
    """Counts the calls that reach the oneDNN linear kernel (None: this build has none)."""
    from mixedad.op_rules import _frozen_layers

    real = _frozen_layers.onednn_linear_op()
    calls = []
    if real is not None:
        def spy(*args):
            calls.append(args[0].shape)
            return real(*args)

        monkeypatch.setattr(_frozen_layers, "onednn_linear_op", lambda: spy)
    return real, calls


TANGENT_LAYOUTS = {
    "contiguous": lambda: torch.randn(4, 6),
    "3d": lambda: torch.randn(2, 3, 6),
    "expanded": lambda: torch.randn(6).expand(4, 6),
    "strided": lambda: torch.randn(4, 12)[:, ::2],
    "empty_batch": lambda: torch.randn(0, 6),
}


@pytest.mark.parametrize("layout", sorted(TANGENT_LAYOUTS))
def test_float32_linear_tangent_takes_onednn_and_matches(layout, onednn_spy):
    real, calls = onednn_spy
    torch.manual_seed(0)
    layer = nn.Linear(6, 5)
    t = TANGENT_LAYOUTS[layout]()
    x = torch.randn(t.shape)
    with torch.no_grad():
        primal_plain = layer(x)
    primal, tangent, _ = _forward("test", layer, (x,), (t,), OpRules("test"))
    _, general, _ = _forward("test", layer, (x,), (t,), None)
    assert torch.equal(primal[0], primal_plain)  # the primal is the user's own call, bit for bit
    assert_close(tangent[0], general[0], rtol=1e-5)
    assert tangent[0].shape == t.shape[:-1] + (5,)
    if real is None:
        pytest.skip("this PyTorch build has no oneDNN linear kernel; the BLAS path was checked")
    assert len(calls) == 1


def test_float64_and_disabled_onednn_take_the_blas(onednn_spy):
    _, calls = onednn_spy
    layer = nn.Linear(6, 5)
    x, t = torch.randn(4, 6), torch.randn(4, 6)
    _forward("test", layer.double(), (x.double(),), (t.double(),), OpRules("test"))
    assert calls == []
    layer.float()
    with _mkldnn_off():
        _, tangent, _ = _forward("test", layer, (x,), (t,), OpRules("test"))
    assert calls == []
    assert torch.equal(tangent[0], torch.nn.functional.linear(t, layer.weight).detach())


def _mkldnn_off():
    import contextlib
    import warnings

    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.filterwarnings("ignore", "TF32 acceleration on top of oneDNN", UserWarning)
    stack.enter_context(torch.backends.mkldnn.flags(enabled=False))
    return stack


def test_onednn_probe_leaves_the_rng_alone():
    from mixedad.op_rules import _frozen_layers

    _frozen_layers.onednn_linear_op.cache_clear()
    state = torch.get_rng_state()
    _frozen_layers.onednn_linear_op()
    assert torch.equal(torch.get_rng_state(), state)


def test_benchmark_strategy_without_onednn_takes_the_blas_and_agrees(onednn_spy):
    import mixedad
    from mixedad import benchmark, zoo

    real, calls = onednn_spy
    G = zoo.mlp(3, 16)
    z, y, v = torch.randn(4, 16), torch.randn(4, 16), torch.randn(4, 16)
    with mixedad.programs.per_op_pass():  # the per-op pass's calls, one per layer (a second call would check G's program too)
        without = benchmark.STRATEGIES["mixed_grad_no_onednn"](benchmark.objective, G, z, y, v)
        assert calls == []
        with_onednn = benchmark.STRATEGIES["mixed_grad"](benchmark.objective, G, z, y, v)
    assert len(calls) == (3 if real is not None else 0)
    assert_close(with_onednn, without, rtol=1e-5)
    assert torch.backends.mkldnn.enabled  # the strategy restored the flag


def test_cpu_autocast_keeps_tangent_and_primal_in_one_dtype(onednn_spy):
    _, calls = onednn_spy
    from mixedad import zoo

    G = zoo.mlp(3, 16)
    z, v = torch.randn(4, 16), torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        primal, tangent, _ = _forward("test", G, (z,), (v,), OpRules("test"))
    assert calls == []
    assert primal[0].dtype == tangent[0].dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad(), torch.autograd.forward_ad.dual_level():
        expected = torch.autograd.forward_ad.unpack_dual(G(torch.autograd.forward_ad.make_dual(z, v))).tangent
    assert torch.equal(tangent[0], expected)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")
def test_linear_without_input_features_takes_the_blas():
    """oneDNN refuses an inner product of length 0; the rule must not hand it one."""
    import mixedad

    G = nn.Sequential(nn.Linear(4, 0), nn.Linear(0, 3))
    z, y = torch.randn(2, 4), torch.randn(2, 3)
    f = lambda y, g: ((y + g) ** 3).sum()  # noqa: E731
    from mixedad.reference import double_backward_mixed_grad

    assert_close(mixedad.mixed_grad(f, G, z, y), double_backward_mixed_grad(f, G, z, y, torch.ones_like(z)))


def test_onednn_probe_ignores_default_dtype_and_device():
    from mixedad.op_rules import _frozen_layers

    if _frozen_layers.onednn_linear_op() is None:
        pytest.skip("this PyTorch build has no oneDNN linear kernel")
    _frozen_layers.onednn_linear_op.cache_clear()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            assert _frozen_layers.onednn_linear_op() is not None
    finally:
        torch.set_default_dtype(previous)


def test_generator_that_vmaps_inside_takes_general_forward_ad():
    """A G that calls torch.func.vmap itself: the rules step aside for the transform's tensors."""
    lin = nn.Linear(6, 5).double()

    def G(z):
        return torch.func.vmap(lin)(z)

    z, t = torch.randn(4, 6, dtype=F64), torch.randn(4, 6, dtype=F64)
    fast = _forward("test", G, (z,), (t,), OpRules("test"))
    general = _forward("test", G, (z,), (t,), None)
    assert_close(fast[1][0], general[1][0], rtol=1e-12)
    assert_close(fast[1][0], torch.nn.functional.linear(t, lin.weight).detach(), rtol=1e-12)


# A batch of tangents: each frozen layer as one call on k tangents (batched or unbatched input).
BATCHED_CASES = {
    "linear": (lambda x, w: F.linear(x, w), (2, 5), (3, 5)),
    "conv1d": (lambda x, w: F.conv1d(x, w, padding=1), (2, 3, 7), (4, 3, 3)),
    "conv2d": (lambda x, w: F.conv2d(x, w, stride=2), (2, 3, 6, 6), (4, 3, 3, 3)),
    "conv2d unbatched input": (lambda x, w: F.conv2d(x, w), (3, 6, 6), (4, 3, 3, 3)),
    "conv3d": (lambda x, w: F.conv3d(x, w), (1, 2, 4, 4, 4), (3, 2, 2, 2, 2)),
    "conv_transpose2d": (lambda x, w: F.conv_transpose2d(x, w, stride=2), (2, 3, 4, 4), (3, 4, 3, 3)),
    "batch_norm eval": (lambda x, w: F.batch_norm(x, w[0], w[1].abs() + 0.5, training=False), (2, 3, 4), (2, 3)),
}


@pytest.mark.parametrize("name", list(BATCHED_CASES))
def test_a_batch_of_tangents_takes_the_frozen_rule_in_one_call(name):
    from mixedad._frontend.batched import push_tangents
    from mixedad._frontend.tangents import push_tangent
    from mixedad.op_rules import PathRecorder

    op, x_shape, w_shape = BATCHED_CASES[name]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(w_shape, generator=gen, dtype=torch.float64)
    x, vs = torch.randn(x_shape, generator=gen, dtype=torch.float64), torch.randn(5, *x_shape, generator=gen, dtype=torch.float64)
    G = lambda t: op(t, w)  # noqa: E731
    recorder = PathRecorder()
    _, tangents, _ = push_tangents("test", G, [x], [vs], recorder=recorder)
    loop = torch.stack([push_tangent("test", G, [x], [v])[1][0] for v in vs])
    assert torch.allclose(tangents[0], loop, rtol=1e-12, atol=1e-14)
    assert [(path, n) for (_, path, _), n in recorder.counts.items()] == [("frozen layer", 1)]


@pytest.mark.parametrize("layer", ["batchnorm2d_train", "batchnorm1d_train_sequence", "batchnorm2d_no_running_stats"])
def test_batch_statistics_take_the_written_rule_alone_and_in_a_batch_of_tangents(layer):
    """Training-mode batch norm takes the frozen-layer rule, one tangent or k at a time, exact against double backward."""
    import mixedad
    from mixedad.reference import double_backward_mixed_jacobian

    build, shape = LAYERS[layer]
    torch.manual_seed(0)
    G = nn.Sequential(nn.Conv1d(shape[1], shape[1], 1) if len(shape) == 3 else nn.Identity(), build()).to(F64)
    if len(shape) == 4:
        G[0] = nn.Conv2d(shape[1], shape[1], 3, padding=1).to(F64)
    G.requires_grad_(False)
    z, y = torch.randn(shape, dtype=F64), torch.randn(shape, dtype=F64)
    report = mixedad.tangent_report(G, z)
    assert "torch.nn.functional.batch_norm" in str(report) and "frozen layer" in str(report)
    assert "PyTorch's formula" not in str(report)
    f = lambda y_, g: ((y_ + g) ** 3).sum()  # noqa: E731
    before = {k: v.clone() for k, v in G.state_dict().items()}
    expected = double_backward_mixed_jacobian(f, G, z, y)
    G.load_state_dict(before)
    assert_close(mixedad.mixed_jacobian(f, G, z, y, chunk_size=4), expected, rtol=1e-10)
    if layer != "batchnorm2d_no_running_stats":
        return  # running statistics updated in place: vmap over mixed_grad refuses them (tested with the batch)
    vs = torch.randn(3, *shape, dtype=F64)
    batched = torch.func.vmap(lambda v: mixedad.mixed_grad(f, G, z, y, v))(vs)
    rows = expected.reshape(z.numel(), y.numel())  # mixed_jacobian: z.shape + y.shape
    assert_close(batched, torch.stack([v.reshape(-1) @ rows for v in vs]).reshape(3, *y.shape), rtol=1e-10)


def _eval_bn(channels, dims):
    bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims](channels).eval()
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
        bn.bias.normal_()
    return bn


class ReusesItsConvolution(nn.Sequential):
    """conv -> bn, and the convolution's output once more: no fold may apply."""

    def forward(self, x):
        h = self[0](x)
        return self[1](h) + h


def _output_kept_by_a_hook():
    G = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), _eval_bn(4, 2), nn.ReLU())
    kept = []
    G[0].register_forward_hook(lambda m, x, y: kept.append(y))
    return nn.Sequential(G, nn.Identity()), kept


FOLD_CASES = {  # name: (G, input shape, folds expected)
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(3, 4, 3), _eval_bn(4, 1), nn.ReLU()), (2, 3, 9), 1),
    "conv2d_no_affine_bn": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, affine=False).eval()),
                            (2, 3, 6, 6), 1),
    "conv3d": (lambda: nn.Sequential(nn.Conv3d(2, 3, 2), _eval_bn(3, 3)), (1, 2, 4, 4, 4), 1),
    "conv_transpose2d_stack": (lambda: nn.Sequential(nn.ConvTranspose2d(3, 4, 4, 2, 1, bias=False), _eval_bn(4, 2),
                                                     nn.ReLU(), nn.Conv2d(4, 5, 3, padding=1), _eval_bn(5, 2),
                                                     nn.Tanh()), (2, 3, 4, 4), 2),
    "conv_transpose1d": (lambda: nn.Sequential(nn.ConvTranspose1d(3, 2, 3), _eval_bn(2, 1)), (2, 3, 5), 1),
    "grouped_conv": (lambda: nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), _eval_bn(4, 2)), (2, 4, 5, 5), 0),
    "train_mode_bn": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4).train()), (4, 3, 5, 5), 0),
    "bn_with_a_pre_hook": (lambda: _with_pre_hook(nn.Sequential(nn.Conv2d(3, 4, 3), _eval_bn(4, 2))), (2, 3, 5, 5), 0),
    "conv_output_reused": (lambda: ReusesItsConvolution(nn.Conv2d(3, 4, 3, padding=1), _eval_bn(4, 2)),
                           (2, 3, 5, 5), 0),
    "conv_output_kept_by_a_hook": (lambda: _KeptOutput(), (2, 3, 5, 5), 0),
    "same_conv_twice": (lambda: _twice(), (2, 4, 6, 6), 0),
    "channels_last_model": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), _eval_bn(4, 2), nn.ReLU(),
                                                  nn.Conv2d(4, 4, 3), _eval_bn(4, 2)).to(memory_format=torch.channels_last),
                            (2, 3, 7, 7), 2),
    "channels_last_weight_only": (lambda: _channels_last_weight(), (2, 3, 7, 7), 1),
    # Found by a review: an unbatched convolution has its channels at 0, the BatchNorm after it normalises dim 1.
    "unbatched_conv": (lambda: nn.Sequential(nn.Conv1d(2, 3, 3), _eval_bn(3, 1), nn.Tanh()), (2, 5), 0),
    "conv_forward_replaced_on_the_instance": (lambda: _replaced_forward(0, lambda m, x: type(m).forward(m, x) * 2),
                                              (2, 3, 6, 6), 0),
    "bn_forward_replaced_on_the_instance": (lambda: _replaced_forward(1, lambda m, x: type(m).forward(m, x * 3)),
                                            (2, 3, 6, 6), 0),
    "sequential_with_its_own_iteration": (lambda: _OwnIteration(nn.Conv2d(3, 4, 3), _eval_bn(4, 2)), (2, 3, 6, 6), 0),
}


def _replaced_forward(index, forward):
    G = nn.Sequential(nn.Conv2d(3, 4, 3), _eval_bn(4, 2))
    module = G[index]
    module.forward = lambda x: forward(module, x)
    return G


class _OwnIteration(nn.Sequential):
    """Iterates its children its own way (here: the convolution's output goes through a doubling first)."""

    def __iter__(self):
        children = list(self._modules.values())
        return iter([children[0], _Double(), *children[1:]])


class _Double(nn.Module):
    def forward(self, x):
        return 2 * x


def _channels_last_weight():
    """A convolution whose weight alone is channels_last: the folded weight may come out in another layout."""
    G = nn.Sequential(nn.Conv2d(3, 4, 3), _eval_bn(4, 2))
    G[0].weight = nn.Parameter(G[0].weight.detach().to(memory_format=torch.channels_last))
    return G


def _with_pre_hook(G):
    G[1].register_forward_pre_hook(lambda m, x: (x[0] * 1.0,))
    return G


def _twice():
    conv = nn.Conv2d(4, 4, 3, padding=1)
    return nn.Sequential(conv, _eval_bn(4, 2), conv, _eval_bn(4, 2))


class _KeptOutput(nn.Module):
    """A forward hook keeps the convolution's output, which G adds to its result."""

    def __init__(self):
        super().__init__()
        self.inner, self.kept = _output_kept_by_a_hook()

    def forward(self, x):
        self.kept.clear()
        return self.inner(x) + self.kept[0]


@pytest.mark.parametrize("name", sorted(FOLD_CASES))
def test_eval_batchnorm_folds_into_the_convolution_before_it_only_where_nothing_else_sees_it(name, monkeypatch):
    """The fold saves the tangent's scaling pass; wherever the convolution's output could reach more than the
    BatchNorm (hooks, a reused output, a shared module, train mode, groups) it does not apply, and every case is
    exact against double backward."""
    import mixedad
    from mixedad.op_rules import _frozen_layers
    from mixedad.reference import double_backward_mixed_grad

    folds = []
    real = _frozen_layers._folded_into
    monkeypatch.setattr(_frozen_layers, "_folded_into", lambda *a: folds.append(real(*a)) or folds[-1])
    monkeypatch.setattr(_frozen_layers, "FOLD_RATIO", 0)  # these layers are small: fold whatever the weight's size
    build, shape, expected_folds = FOLD_CASES[name]
    torch.manual_seed(0)
    G = build().to(F64).requires_grad_(False)
    z, v = torch.randn(shape, dtype=F64), torch.randn(shape, dtype=F64)
    state = {k: t.clone() for k, t in G.state_dict().items()}
    with torch.no_grad():
        y = torch.randn(G(z).shape, dtype=F64)
    G.load_state_dict(state)
    f = lambda y_, g: ((y_ + g) ** 3).sum()  # noqa: E731
    ours = mixedad.mixed_grad(f, G, z, y, v)
    assert sum(folds) == expected_folds
    G.load_state_dict(state)
    assert_close(ours, double_backward_mixed_grad(f, G, z, y, v), rtol=1e-10)


def test_a_folded_tangent_in_another_layout_than_the_primal_still_reaches_its_batchnorm(monkeypatch):
    """make_dual copies a tangent whose strides differ from the primal's; the rule copies it first, so the
    BatchNorm finds the folded tangent itself and does not scale it twice."""
    import mixedad
    from mixedad.op_rules import _frozen_layers
    from mixedad.reference import double_backward_mixed_grad

    real_fold, real_into, folds = _frozen_layers._fold, _frozen_layers._folded_into, []

    def contiguous_fold(op):
        found = real_fold(op)
        return None if found is None else (found[0].contiguous(), found[1])

    monkeypatch.setattr(_frozen_layers, "_fold", contiguous_fold)
    monkeypatch.setattr(_frozen_layers, "FOLD_RATIO", 0)
    monkeypatch.setattr(_frozen_layers, "_folded_into", lambda *a: folds.append(real_into(*a)) or folds[-1])
    torch.manual_seed(0)
    G = _channels_last_weight().to(F64).requires_grad_(False)
    z, v = torch.randn(2, 3, 7, 7, dtype=F64), torch.randn(2, 3, 7, 7, dtype=F64)
    y = torch.randn(2, 4, 5, 5, dtype=F64)
    f = lambda y_, g: ((y_ + g) ** 3).sum()  # noqa: E731
    assert_close(mixedad.mixed_grad(f, G, z, y, v), double_backward_mixed_grad(f, G, z, y, v), rtol=1e-10)
    assert folds == [True]


def test_a_folded_tangent_that_does_not_reach_its_batchnorm_is_refused_not_scaled_twice():
    """Never expected; if another tensor than the folded tangent reaches the BatchNorm, the rule raises."""
    import weakref

    from mixedad.op_rules import _frozen_layers
    from mixedad._ground.errors import OpRuleError

    bn = nn.BatchNorm2d(2).eval()
    folded = torch.ones(1, 2, 3, 3)
    _frozen_layers._FOLD.pending = (weakref.ref(folded), weakref.ref(bn.running_var))
    try:
        with pytest.raises(OpRuleError, match="folded the BatchNorm's scale"):  # rules see an alias of the buffer
            _frozen_layers._folded_into(torch.ones(1, 2, 3, 3), {"running_var": bn.running_var.view_as(bn.running_var)})
        assert _frozen_layers._FOLD.pending is None
    finally:
        _frozen_layers.forget_folds()



@pytest.mark.parametrize("case", ["one value per channel", "eval without running statistics", "empty batch"])
def test_batch_norm_raises_and_runs_where_f_batch_norm_does(case):
    """Found by a review: the rule must not skip F.batch_norm's own checks, nor fail where it runs."""
    import mixedad
    from mixedad.reference import double_backward_mixed_grad

    if case == "one value per channel":
        G, shape, error = nn.BatchNorm1d(4).train().to(F64), (1, 4), ValueError
    elif case == "eval without running statistics":
        G, shape, error = (lambda x: F.batch_norm(x, None, None, training=False)), (3, 4), RuntimeError
    else:
        G, shape, error = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3).train()).to(F64), (0, 3, 3, 3), None
    z, v = torch.randn(shape, dtype=F64), torch.randn(shape, dtype=F64)
    y = torch.randn(shape[:1] + ((3, 3, 3) if case == "empty batch" else shape[1:]), dtype=F64)
    f = lambda y_, g: ((y_ + g) ** 3).sum()  # noqa: E731
    if error is not None:
        with pytest.raises(error):
            G(z)
        with pytest.raises(error):
            mixedad.mixed_grad(f, G, z, y, v)
    else:
        assert_close(mixedad.mixed_grad(f, G, z, y, v), double_backward_mixed_grad(f, G, z, y, v))


@pytest.mark.parametrize("depth, width, batch", [(0, 32, 8), (4, 32, 32), (1, 64, 2)])
def test_the_fold_leaves_the_peak_exactly_as_without_it(depth, width, batch, monkeypatch):
    """Exact bytes. Two ways a fold could raise the peak, both found measuring this: the frame's locals
    snapshot (before Python 3.13) kept the Sequential's input alive, and the folded weight, a copy, lived
    beside the primal's output. Now the snapshot is cleared, the tangent goes first, and a weight larger
    than 1/FOLD_RATIO of the input is not folded."""
    import mixedad
    from mixedad.benchmark import build, objective
    from mixedad.op_rules import _frozen_layers
    from mixedad.profiling import peak_memory

    G, z, y, v = build("dcgan", depth, width, batch, torch.float32, "cpu")
    G.requires_grad_(False)
    folds = []
    real = _frozen_layers._folded_into
    monkeypatch.setattr(_frozen_layers, "_folded_into", lambda *a: folds.append(real(*a)) or folds[-1])
    with mixedad.programs.per_op_pass():  # the per-op pass's fold (tangent programs fold on their own: tests/_programs)
        _, with_fold = peak_memory(lambda: mixedad.mixed_grad(objective, G, z, y, v))
        monkeypatch.setattr(_frozen_layers, "_fold", lambda op: None)
        _, without = peak_memory(lambda: mixedad.mixed_grad(objective, G, z, y, v))
    assert with_fold == without
    if (depth, width, batch) == (4, 32, 32):
        assert any(folds)  # the benchmark's DCGAN does fold


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("size", [1.0, 0.01, 0.003])
def test_train_mode_batch_norm_in_reduced_precision_takes_the_kernels_and_never_overflows(dtype, size):
    """float16 inputs of size 0.01: PyTorch's forward-AD formula for batch norm overflows to NaN where double
    backward's kernel stays finite (a review found it); the rule takes the kernels in float16 and bfloat16 too."""
    import copy

    import mixedad
    from mixedad.reference import double_backward_mixed_grad
    torch.manual_seed(0)
    G = nn.Sequential(nn.BatchNorm1d(32)).to(dtype).requires_grad_(False)
    z, y, v = (torch.randn(16, 32) * size).to(dtype), torch.randn(16, 32).to(dtype), torch.randn(16, 32).to(dtype)
    f = lambda y, g: (y * g).sum()  # noqa: E731
    with mixedad.programs.per_op_pass():
        ours = mixedad.mixed_grad(f, copy.deepcopy(G), z, y, v)
    reference = double_backward_mixed_grad(f, copy.deepcopy(G).double(), z.double(), y.double(), v.double())
    assert torch.isfinite(ours).all()
    assert ((ours.double() - reference).norm() / reference.norm()).item() < (1e-2 if dtype == torch.float16 else 5e-2)
