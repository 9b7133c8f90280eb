"""compile=True: the compiled tangent program against the eager pass and double backward, its cache, its fallbacks."""
import functools
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixedad
from mixedad._programs import cache
from mixedad.reference import double_backward_mixed_grad
from tests._programs.common import D, f
from tests._programs.common import problem as _problem

UNSUPPORTED = {"transformer_layer": "TransformerEncoderLayer", "stylegan2_ada": "custom torch.autograd.Function"}


@pytest.mark.parametrize("name", sorted(mixedad.zoo.MEMBERS))
def test_every_zoo_generator_compiled_equals_eager_and_double_backward(name, capsys):
    G = mixedad.zoo.MEMBERS[name](dtype=D).eval()
    z, y, v = _problem(G)
    eager = mixedad.mixed_grad(f, G, z, y, v)
    reference = double_backward_mixed_grad(f, G, z, y, v)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = mixedad.mixed_grad(f, G, z, y, v, compile=True)
        second = mixedad.mixed_grad(f, G, z, y, v, compile=True)
    [entry] = mixedad.programs.compiled_tangents(G)
    if name in UNSUPPORTED:
        assert entry.status == "eager" and UNSUPPORTED[name] in entry.reason
        assert any(UNSUPPORTED[name] in str(w.message) for w in caught)
        assert torch.equal(first, eager) and torch.equal(second, eager)
        return
    ours = [str(w.message) for w in caught if str(w.message).startswith("mixedad")]
    assert not ours, ours
    assert entry.status == "compiled" and entry.compile_seconds > 0 and entry.difference <= 1e-9
    assert "compiling the tangent program" in capsys.readouterr().err
    assert torch.equal(first, eager)  # the first call returns the eager pass's numbers
    scale = reference.abs().max()
    assert (second - reference).abs().max() <= 1e-9 * scale
    assert (second - eager).abs().max() <= 1e-9 * scale


def _mlp():
    return mixedad.zoo.mlp(3, 8, dtype=D)


def test_the_cache_compiles_once_per_key():
    G = _mlp()
    z, y, v = _problem(G)
    for _ in range(3):
        mixedad.mixed_grad(f, G, z, y, v, compile=True)
    assert len(mixedad.programs.compiled_tangents(G)) == 1
    z2, y2, v2 = _problem(G, batch=5)
    mixedad.mixed_grad(f, G, z2, y2, v2, compile=True)
    G.train()
    mixedad.mixed_grad(f, G, z, y, v, compile=True)
    entries = mixedad.programs.compiled_tangents(G)
    assert [e.inputs[0][0] for e in entries] == [(3, 8), (5, 8), (3, 8)]
    assert all(e.status == "compiled" for e in entries)


def test_a_compiler_that_drops_a_tangent_is_caught_and_eager_runs(monkeypatch):
    def dropping(entry, batch, n):
        def run(*args):
            primals, tangents = entry.program(*args)
            return primals, tuple(torch.zeros_like(t) for t in tangents)
        return run

    monkeypatch.setattr(cache, "_compile", dropping)
    G = _mlp()
    z, y, v = _problem(G)
    eager = mixedad.mixed_grad(f, G, z, y, v)
    with pytest.warns(RuntimeWarning, match="differs from the eager pass"):
        first = mixedad.mixed_grad(f, G, z, y, v, compile=True)
    second = mixedad.mixed_grad(f, G, z, y, v, compile=True)
    assert torch.equal(first, eager) and torch.equal(second, eager)
    [entry] = mixedad.programs.compiled_tangents(G)
    assert entry.status == "eager" and entry.difference == 1.0


def test_a_compile_that_fails_falls_back_with_a_warning(monkeypatch):
    def failing(entry, batch, n):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cache, "_compile", failing)
    G = _mlp()
    z, y, v = _problem(G)
    with pytest.warns(RuntimeWarning, match="torch.compile failed.*no C\\+\\+ compiler"):
        out = mixedad.mixed_grad(f, G, z, y, v, compile=True)
    assert torch.equal(out, mixedad.mixed_grad(f, G, z, y, v))


def test_train_mode_batch_norm_updates_buffers_once_per_call():
    G = mixedad.zoo.MEMBERS["dcgan"](dtype=D).train()
    z, y, v = _problem(G)
    start = {k: b.clone() for k, b in G.state_dict().items()}
    outs = [mixedad.mixed_grad(f, G, z, y, v, compile=True) for _ in range(2)]
    compiled_state = {k: b.clone() for k, b in G.state_dict().items()}
    G.load_state_dict(start)
    expected = [mixedad.mixed_grad(f, G, z, y, v) for _ in range(2)]
    for k, b in G.state_dict().items():
        assert torch.allclose(compiled_state[k], b, rtol=1e-12, atol=1e-12), k
    for a, b in zip(outs, expected):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)


def test_weights_changed_in_place_are_seen():
    G = _mlp()
    z, y, v = _problem(G)
    mixedad.mixed_grad(f, G, z, y, v, compile=True)
    with torch.no_grad():
        G[0].weight.mul_(2)
    out = mixedad.mixed_grad(f, G, z, y, v, compile=True)
    assert torch.allclose(out, mixedad.mixed_grad(f, G, z, y, v), rtol=1e-10)


def test_mixed_jacobian_compiles_the_batch():
    G = _mlp()
    z, y, _ = _problem(G, batch=2)
    eager = mixedad.mixed_jacobian(f, G, z, y, chunk_size=4)
    out = mixedad.mixed_jacobian(f, G, z, y, chunk_size=4, compile=True)
    assert torch.allclose(out, eager, rtol=1e-10, atol=1e-12)
    assert {e.tangents for e in mixedad.programs.compiled_tangents(G)} == {4}
    assert all(e.status == "compiled" for e in mixedad.programs.compiled_tangents(G))


def test_input_grad_compiles_its_backward():
    G = _mlp()
    z, y, _ = _problem(G)
    grads = []
    for compile in (False, True, True):
        yr = y.clone().requires_grad_()
        (mixedad.input_grad(f, G, z, yr, compile=compile) ** 2).sum().backward()
        grads.append(yr.grad)
    assert torch.allclose(grads[1], grads[0], rtol=1e-10) and torch.allclose(grads[2], grads[0], rtol=1e-10)
    assert [e.status for e in mixedad.programs.compiled_tangents(G)] == ["compiled"]


def test_bad_arguments_and_what_runs_eager():
    G = _mlp()
    z, y, v = _problem(G)
    with pytest.raises(TypeError, match="compile"):
        mixedad.mixed_grad(f, G, z, y, v, compile="yes")
    with pytest.raises(ValueError, match="strategy='reverse'"):
        mixedad.mixed_grad(f, G, z, y, v, compile=True, strategy="reverse")
    with pytest.warns(RuntimeWarning, match="nn.Module"):
        out = mixedad.mixed_grad(f, lambda x: G(x), z, y, v, compile=True)
    assert torch.equal(out, mixedad.mixed_grad(f, G, z, y, v))
    hooked = _mlp()
    hooked[0].register_forward_hook(lambda *a: None)
    with pytest.warns(RuntimeWarning, match="hooks"):
        mixedad.mixed_grad(f, hooked, z, y, v, compile=True)


GAIN = 1.0


class _Truncated(nn.Module):
    """A custom module whose forward reads attributes of many kinds, a parameter, a buffer, a function it
    holds and a global."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.act = nn.LeakyReLU(0.1)
        self.psi, self._private = 0.7, 1.0
        self.cfg, self.space = {"scale": 1.0}, types.SimpleNamespace(scale=1.0)
        self.scales = [1.0, torch.tensor(1.0)]
        self.scale = nn.Parameter(torch.ones(8))
        self.register_buffer("shift", torch.zeros(8))
        self.fn = torch.tanh

    def forward(self, z):
        h = self.act(self.linear(z)) * self.psi * self._private * self.cfg["scale"] * self.space.scale
        return self.fn(h * self.scales[0] * GAIN * self.scale + self.shift)


CHANGES = ["attribute", "private", "dict", "namespace", "list", "global", "layer_setting", "parameter", "buffer",
           "function", "weights"]


@pytest.mark.parametrize("change", CHANGES)
def test_a_program_follows_what_g_holds_after_a_change(change):
    G = _Truncated().to(D)
    z, y, v = _problem(mixedad.zoo.mlp(2, 8, dtype=D))
    mixedad.mixed_grad(f, G, z, y, v, compile=True)
    global GAIN
    with torch.no_grad():
        if change == "attribute":
            G.psi = 0.3
        elif change == "private":
            G._private = 1.7
        elif change == "dict":
            G.cfg["scale"] = 1.3
        elif change == "namespace":
            G.space.scale = 0.6
        elif change == "list":
            G.scales[0] = 2.0
        elif change == "global":
            GAIN = 1.5
        elif change == "layer_setting":
            G.act.negative_slope = 0.9
        elif change == "parameter":
            G.scale = nn.Parameter(torch.full((8,), 2.0, dtype=D))
        elif change == "buffer":
            G.shift = torch.full((8,), 0.5, dtype=D)
        elif change == "function":
            G.fn = torch.sigmoid
        else:
            G.linear.weight.mul_(3)
    try:
        out = mixedad.mixed_grad(f, G, z, y, v, compile=True)
        reference = double_backward_mixed_grad(f, G, z, y, v)
    finally:
        GAIN = 1.0
    assert (out - reference).abs().max() <= 1e-9 * reference.abs().max()
    assert len(mixedad.programs.compiled_tangents(G)) == (1 if change == "weights" else 2)


class _Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, z):
        self.calls += 1
        return self.linear(z)


def test_a_forward_that_sets_its_attributes_runs_eager_and_counts():
    G = _Counter().to(D)
    z, y, v = _problem(mixedad.zoo.mlp(2, 8, dtype=D))
    with pytest.warns(RuntimeWarning, match="sets or changes the attribute _Counter.calls"):
        mixedad.mixed_grad(f, G, z, y, v, compile=True)
    mixedad.mixed_grad(f, G, z, y, v, compile=True)
    assert G.calls == 2  # one per call, as a plain forward counts


class _InPlace(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind, self.linear = kind, nn.Linear(8, 8)
        self.elu = nn.ELU(inplace=True)

    def forward(self, z):
        h = self.linear(z)
        if self.kind == "elu":
            return self.elu(h * 1)
        if self.kind == "view":
            h[:, 0].zero_()
            return h * 2
        h += 1.0
        return h


@pytest.mark.parametrize("kind", ["elu", "view", "iadd"])
def test_in_place_writes_run_eager(kind):
    G = _InPlace(kind).to(D)
    z, y, v = _problem(mixedad.zoo.mlp(2, 8, dtype=D))
    with pytest.warns(RuntimeWarning, match="in place"):
        out = mixedad.mixed_grad(f, G, z, y, v, compile=True)
    assert torch.equal(out, mixedad.mixed_grad(f, G, z, y, v))


def test_a_tangent_that_is_zero_in_exact_arithmetic_is_no_compiler_bug():
    G = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).to(D).train()  # ones: BN removes them
    z = torch.randn(5, 8, dtype=D)
    G[0].weight.data.fill_(0.1)
    y = torch.randn(5, 3, dtype=D)
    mixedad.mixed_grad(f, G, z, y, compile=True)
    [entry] = mixedad.programs.compiled_tangents(G)
    assert entry.status == "compiled", entry.reason


def test_keyword_inputs_unbatched_instance_norm_and_broadcast_tangents():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.inorm, self.linear = nn.LayerNorm(8), nn.InstanceNorm1d(4, affine=True), nn.Linear(8, 8)
            self.offset = nn.Parameter(torch.randn(5, 8))

        def forward(self, z):
            h = self.norm(input=self.linear(z))
            u = self.inorm(h.reshape(4, -1)).view(-1)
            broadcast = (z[:1] + self.offset).view(40)  # its tangent is z's, expanded: view() refuses that
            return F.gelu(input=h) + broadcast.reshape(5, 8) + u.sum()

    G = Odd().to(D)
    z, y, v = _problem(mixedad.zoo.mlp(2, 8, dtype=D), batch=5)
    out = mixedad.mixed_grad(f, G, z, y, v, compile=True)
    [entry] = mixedad.programs.compiled_tangents(G)
    assert entry.status == "compiled", entry.reason
    reference = double_backward_mixed_grad(f, G, z, y, v)
    assert (out - reference).abs().max() <= 1e-9 * reference.abs().max()


def test_eval_dropout_functions_compile_and_method_draws_run_eager():
    class Drops(nn.Module):
        def __init__(self, draw):
            super().__init__()
            self.linear, self.draw = nn.Linear(8, 8), draw

        def forward(self, z):
            h = F.dropout(self.linear(z), 0.5, training=False)
            return h + torch.empty_like(h).normal_() if self.draw else h

    z, y, v = _problem(mixedad.zoo.mlp(2, 8, dtype=D))
    G = Drops(False).to(D)
    mixedad.mixed_grad(f, G, z, y, v, compile=True)
    assert mixedad.programs.compiled_tangents(G)[0].status == "compiled"
    G = Drops(True).to(D)
    with pytest.warns(RuntimeWarning, match="random"):
        mixedad.mixed_grad(f, G, z, y, v, compile=True)


def test_a_dtype_error_is_the_users_not_a_compile_warning():
    G = mixedad.zoo.mlp(2, 8, dtype=D)
    z, y, v = _problem(G)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(RuntimeError, match="dtype|Double|Float"):
            mixedad.mixed_grad(f, G, z.float(), y, v.float(), compile=True)


def test_compile_under_vmap_says_it_runs_eager():
    G = _mlp()
    z, y, _ = _problem(G)
    with pytest.warns(RuntimeWarning, match="inside torch.func.vmap"):
        torch.func.vmap(lambda v: mixedad.mixed_grad(f, G, z, y, v, compile=True))(torch.randn(3, *z.shape, dtype=D))


def test_an_in_place_activation_on_a_view_runs_eager():
    class View(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.act = nn.Linear(8, 8), nn.ReLU(inplace=True)

        def forward(self, z):
            h = self.linear(z)
            self.act(h[:, :1])  # writes into h
            return h * 2

    G = View().to(D)
    z, y, v = _problem(mixedad.zoo.mlp(2, 8, dtype=D))
    with pytest.warns(RuntimeWarning, match="shares memory"):
        mixedad.mixed_grad(f, G, z, y, v, compile=True)
    relu_after_a_layer = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8)).to(D)
    mixedad.mixed_grad(f, relu_after_a_layer, z, y, v, compile=True)
    assert mixedad.programs.compiled_tangents(relu_after_a_layer)[0].status == "compiled"


def test_shapes_read_as_ndim_and_numel_and_defaults_of_forward_are_fixed():
    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, z, temb=None, scale=2.0):
            if z.ndim == 2 and z.numel() > 0:
                z = z * scale
            h = self.linear(z)
            return h if temb is None else h + temb

    G = Reads().to(D)
    z, y, v = _problem(mixedad.zoo.mlp(2, 8, dtype=D))
    out = mixedad.mixed_grad(f, G, z, y, v, compile=True)
    assert mixedad.programs.compiled_tangents(G)[0].status == "compiled"
    assert torch.allclose(out, double_backward_mixed_grad(f, G, z, y, v), rtol=1e-10)


def test_programs_per_g_are_capped_least_recently_used_first(monkeypatch):
    monkeypatch.setattr(cache, "MAX_PROGRAMS", 2)
    G = _mlp()
    problems = [_problem(G, batch=b) for b in (2, 3, 4)]
    for z, y, v in problems[:2]:
        mixedad.mixed_grad(f, G, z, y, v, compile=True)
    mixedad.mixed_grad(f, G, *problems[0], compile=True)  # batch 2 is now the most recently used
    with pytest.warns(RuntimeWarning, match="least recently used is dropped"):
        mixedad.mixed_grad(f, G, *problems[2], compile=True)
    assert [e.inputs[0][0] for e in mixedad.programs.compiled_tangents(G)] == [(2, 8), (4, 8)]


class _ClassScaled(nn.Module):
    scale = 2.0  # a class attribute

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.plain = torch.zeros(8)  # a tensor attribute (not a buffer): traced code computes with it once
        self.act = functools.partial(F.leaky_relu, negative_slope=0.1)

    def forward(self, z):
        return torch.tanh(self.act(self.linear(z)) * self.scale + self.plain.exp())


@pytest.mark.parametrize("change", ["class_attribute", "recycled_function", "tensor_in_place", "dtype"])
def test_what_a_key_identifies_cannot_change_behind_it(change):
    G = _ClassScaled().to(D)
    z, y, v = _problem(mixedad.zoo.mlp(2, 8, dtype=D))
    for _ in range(2):
        mixedad.mixed_grad(f, G, z, y, v, compile=True)
    try:
        if change == "class_attribute":
            _ClassScaled.scale = 5.0
        elif change == "recycled_function":
            for slope in (0.3, 0.5, 0.7):  # each old partial freed first: a new one may take its address
                G.act = None
                G.act = functools.partial(F.leaky_relu, negative_slope=slope)
                out = mixedad.mixed_grad(f, G, z, y, v, compile=True)
                reference = double_backward_mixed_grad(f, G, z, y, v)
                assert (out - reference).abs().max() <= 1e-9 * reference.abs().max()
        elif change == "tensor_in_place":
            G.plain.fill_(1.0)
        else:
            G.float()
            z, y, v = z.float(), y.float(), v.float()
        out = mixedad.mixed_grad(f, G, z, y, v, compile=True)
        reference = double_backward_mixed_grad(f, G, z, y, v)
    finally:
        _ClassScaled.scale = 2.0
    tol = 1e-9 if change != "dtype" else 1e-4
    assert (out - reference).abs().max() <= tol * reference.abs().max()
    assert all(e.status == "compiled" for e in mixedad.programs.compiled_tangents(G))


def test_the_trace_leaves_no_constants_on_g_and_one_program_serves_every_call():
    class Embeds(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, z):
            frequencies = torch.exp(-torch.arange(8, dtype=z.dtype) / 8)  # made in forward: a constant of the trace
            return self.linear(z) * frequencies

    G = Embeds().to(D)
    names = set(vars(G))
    z, y, v = _problem(mixedad.zoo.mlp(2, 8, dtype=D))
    for _ in range(3):
        mixedad.mixed_grad(f, G, z, y, v, compile=True)
    assert set(vars(G)) == names
    assert len(mixedad.programs.compiled_tangents(G)) == 1


def test_threads_compiling_and_running_eager_at_once_get_the_right_numbers():
    import threading

    G = _mlp()
    problems = [_problem(G, batch=b, seed=b) for b in (3, 5)]
    expected = [mixedad.mixed_grad(f, G, *p) for p in problems]
    results, errors = {}, []

    def work(i, compile):
        try:
            for r in range(3):
                results[i, r] = mixedad.mixed_grad(f, G, *problems[i], compile=compile)
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i, i == 0)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (i, _), out in results.items():
        assert torch.allclose(out, expected[i], rtol=1e-10, atol=1e-12)
