"""compile=True: the compiled tangent program against the eager pass and double backward, its cache, its fallbacks."""
import warnings

import pytest
import torch
from torch import nn

import mixedad
from mixedad._programs import compiled
from mixedad.reference import double_backward_mixed_grad

D = torch.float64


def f(y, g):
    return ((y + g) ** 3).sum()


def _problem(G, batch=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(*mixedad.zoo.latent_shape(G, batch), dtype=D, generator=gen)
    with torch.no_grad():
        shape = G(z).shape
    return z, torch.randn(shape, dtype=D, generator=gen), torch.randn(z.shape, dtype=D, generator=gen)


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
    [entry] = mixedad.compiled_tangents(G)
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
    assert len(mixedad.compiled_tangents(G)) == 1
    z2, y2, v2 = _problem(G, batch=5)
    mixedad.mixed_grad(f, G, z2, y2, v2, compile=True)
    G.train()
    mixedad.mixed_grad(f, G, z, y, v, compile=True)
    entries = mixedad.compiled_tangents(G)
    assert [e.inputs[0][0] for e in entries] == [(3, 8), (5, 8), (3, 8)]
    assert all(e.status == "compiled" for e in entries)


def test_a_compiler_that_drops_a_tangent_is_caught_and_eager_runs(monkeypatch):
    def dropping(entry, batch, n):
        def run(*args):
            primals, tangents = entry.program(*args)
            return primals, tuple(torch.zeros_like(t) for t in tangents)
        return run

    monkeypatch.setattr(compiled, "_compile", dropping)
    G = _mlp()
    z, y, v = _problem(G)
    eager = mixedad.mixed_grad(f, G, z, y, v)
    with pytest.warns(RuntimeWarning, match="differs from the eager pass"):
        first = mixedad.mixed_grad(f, G, z, y, v, compile=True)
    second = mixedad.mixed_grad(f, G, z, y, v, compile=True)
    assert torch.equal(first, eager) and torch.equal(second, eager)
    [entry] = mixedad.compiled_tangents(G)
    assert entry.status == "eager" and entry.difference == 1.0


def test_a_compile_that_fails_falls_back_with_a_warning(monkeypatch):
    def failing(entry, batch, n):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled, "_compile", failing)
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
    assert {e.tangents for e in mixedad.compiled_tangents(G)} == {4}
    assert all(e.status == "compiled" for e in mixedad.compiled_tangents(G))


def test_input_grad_compiles_its_backward():
    G = _mlp()
    z, y, _ = _problem(G)
    grads = []
    for compile in (False, True, True):
        yr = y.clone().requires_grad_()
        (mixedad.input_grad(f, G, z, yr, compile=compile) ** 2).sum().backward()
        grads.append(yr.grad)
    assert torch.allclose(grads[1], grads[0], rtol=1e-10) and torch.allclose(grads[2], grads[0], rtol=1e-10)
    assert [e.status for e in mixedad.compiled_tangents(G)] == ["compiled"]


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
