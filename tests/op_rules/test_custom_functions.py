"""Custom autograd.Functions with odd backwards, gradient hooks and G that differentiates itself.

Reverse mode is the meaning: every case equals double backward written by hand, or raises a
mixedad error that names the class and the fix.
"""
import warnings

import pytest
import torch

import mixedad
from mixedad.op_rules import _probes as _function_probes
from mixedad.testing import assert_close

F64 = torch.float64
W = torch.randn(5, 5, dtype=F64, generator=torch.Generator().manual_seed(3)) / 2


def double_backward(f, G, z, y, v):
    """The user's own double backward, written out."""
    z = z.detach().requires_grad_()
    y = y.detach().requires_grad_()
    (dz,) = torch.autograd.grad(f(y, G(z)), z, create_graph=True)
    return torch.autograd.grad(dz, y, v)[0]


def f(y, g):
    return ((y + g) ** 3).sum()


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.save_for_forward(*inputs)


def _fn(forward, backward, jvp=None, *, name):
    """A custom Function class (new style: setup_context), fresh per test so probes run again."""
    attrs = {
        "forward": staticmethod(forward),
        "setup_context": staticmethod(_save_inputs),
        "backward": staticmethod(backward),
    }
    if jvp is not None:
        attrs["jvp"] = staticmethod(jvp)
    return type(name, (torch.autograd.Function,), attrs)


def clipped():
    return _fn(lambda x: x.sin(), lambda ctx, g: g.clamp(-0.5, 0.5) * ctx.saved_tensors[0].cos(), name="ClipGrad")


def normalised():
    return _fn(lambda x: x.sin(), lambda ctx, g: g / g.norm() * ctx.saved_tensors[0].cos(), name="NormGrad")


def reversed_gradient():
    return _fn(lambda x: x * 1.0, lambda ctx, g: -0.7 * g, name="GradReverse")


def wrong_jvp():
    def jvp(ctx, t):
        return t * ctx.saved_tensors[0].cos() * 1.5

    return _fn(lambda x: x.sin(), lambda ctx, g: g * ctx.saved_tensors[0].cos(), jvp, name="WrongJvp")


def right_jvp():
    def jvp(ctx, t):
        return t * ctx.saved_tensors[0].cos()

    return _fn(lambda x: x.sin(), lambda ctx, g: g * ctx.saved_tensors[0].cos(), jvp, name="RightJvp")


def around(fn_cls):
    """G with the Function between two layers, so the odd backward sees a real cotangent."""
    def G(z):
        return torch.tanh(fn_cls.apply(torch.tanh(z @ W)) @ W)
    return G


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(4, 5, dtype=F64, generator=gen) for _ in range(3))


NONLINEAR = {"gradient clipping": clipped, "gradient normalisation": normalised}


@pytest.mark.parametrize("strategy", ["auto", "reverse"])
@pytest.mark.parametrize("name", list(NONLINEAR))
def test_a_backward_not_linear_in_its_gradient_gives_double_backward_s_answer(name, strategy):
    G = around(NONLINEAR[name]())
    z, y, v = _problem(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the whole-G fallback warns (checked below)
        ours = mixedad.mixed_grad(f, G, z, y, v, strategy=strategy)
    assert_close(ours, double_backward(f, G, z, y, v), rtol=1e-10, what=name)


def test_the_nonlinear_backward_is_named_in_the_fallback_warning_and_refused_by_forward():
    cls = _fn(lambda x: x.sin(), lambda ctx, g: g.clamp(-0.5, 0.5) * ctx.saved_tensors[0].cos(), name="ClipGradNamed")
    G = around(cls)
    z, y, v = _problem(2)
    with pytest.warns(RuntimeWarning, match="ClipGradNamed .custom Function. has a backward that is not linear"):
        mixedad.mixed_grad(f, G, z, y, v)
    with pytest.raises(RuntimeError, match="ClipGradNamed .custom Function. has a backward that is not linear.*strategy='forward' forbids"):
        mixedad.mixed_grad(f, G, z, y, v, strategy="forward")


def test_create_graph_through_a_nonlinear_backward_is_refused():
    G = around(normalised())
    z, y, v = _problem(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="not linear in its incoming gradient.*create_graph=True would miss"):
            mixedad.mixed_grad(f, G, z, y.requires_grad_(), v, create_graph=True)


def test_input_grad_through_a_nonlinear_backward():
    G = around(clipped())
    z = _problem(4)[0]
    y = torch.randn(5, dtype=F64)
    y1, y2 = y.clone().requires_grad_(), y.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mixedad.input_grad(f, G, z, y1, chunk_size=2).pow(2).sum().backward()
    mixedad.reference.double_backward_input_grad(f, G, z, y2, chunk_size=2).pow(2).sum().backward()
    assert_close(y1.grad, y2.grad, rtol=1e-10)


def test_a_linear_odd_backward_stays_on_the_local_rule():
    """Gradient reversal (-0.7 g) is linear: the local rule, flat, exact, no warning."""
    G = around(reversed_gradient())
    z, y, v = _problem(5)
    assert_close(mixedad.mixed_grad(f, G, z, y, v, strategy="forward"), double_backward(f, G, z, y, v), rtol=1e-10)
    report = mixedad.tangent_report(G, z, v)
    assert report.ops("local double-VJP") == ["GradReverse (custom Function)"] and report.flat


def test_a_jvp_that_disagrees_with_the_backward_warns_and_the_backward_wins():
    G = around(wrong_jvp())
    z, y, v = _problem(6)
    with pytest.warns(RuntimeWarning, match=r"WrongJvp.jvp disagrees with the backward.*<jvp\(t\), u> = \S+ but "
                                            r"<t, backward\(u\)> = \S+"):
        ours = mixedad.mixed_grad(f, G, z, y, v)
    assert_close(ours, double_backward(f, G, z, y, v), rtol=1e-10)
    report = mixedad.tangent_report(G, z, v)  # warned once per class: no second warning
    assert report.ops("local double-VJP") == ["WrongJvp (custom Function)"]


def test_a_jvp_that_agrees_is_used():
    G = around(right_jvp())
    z, y, v = _problem(7)
    assert_close(mixedad.mixed_grad(f, G, z, y, v), double_backward(f, G, z, y, v), rtol=1e-10)
    assert mixedad.tangent_report(G, z, v).ops("forward AD") == ["RightJvp (custom Function)", "torch.Tensor.matmul",
                                                                "torch.tanh"]


def test_probes_leave_the_rng_alone():
    cls = _fn(lambda x: x * torch.rand_like(x), lambda ctx, g: g.clamp(-1, 1), name="RandomClip")
    G = around(cls)
    z, y, v = _problem(8)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = mixedad.mixed_grad(f, G, z, y, v)
    after = torch.get_rng_state()
    torch.manual_seed(0)
    expected = double_backward(f, G, z, y, v)
    assert torch.equal(after, torch.get_rng_state())
    assert_close(ours, expected, rtol=1e-10)


class _InPlaceDouble(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _InPlaceDoubleJvp(_InPlaceDouble):
    @staticmethod
    def jvp(ctx, t):
        return t.mul_(2)


@pytest.mark.parametrize("cls", [_InPlaceDouble, _InPlaceDoubleJvp], ids=["no jvp", "with jvp"])
def test_in_place_functions_mark_dirty(cls):
    def G(z):
        h = z @ W + 0.5  # nothing saves h: the plain double backward allows writing into it
        out = cls.apply(h)
        assert out is h  # written in place, as in a plain call
        return torch.tanh(h @ W)

    z, y, v = _problem(9)
    assert_close(mixedad.mixed_grad(f, G, z, y, v), double_backward(f, G, z, y, v), rtol=1e-10)


class _OldStyle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()


def test_mixed_jacobian_through_old_style_functions_without_jvp():
    G = around(_OldStyle)
    z, y, _ = _problem(10)
    expected = mixedad.reference.double_backward_mixed_jacobian(f, G, z, y)
    assert_close(mixedad.mixed_jacobian(f, G, z, y, chunk_size=6), expected, rtol=1e-10)


def test_vmap_over_tangents_takes_a_function_torch_func_cannot_run():
    """mixedad's own batched pass runs the Function outside torch.func (no setup_context, jvp or vmap needed)."""
    G = around(_OldStyle)
    z, y, _ = _problem(11)
    vs = torch.randn(3, *z.shape, dtype=F64)
    ours = torch.func.vmap(lambda v: mixedad.mixed_grad(f, G, z, y, v))(vs)
    assert_close(ours, torch.stack([double_backward(f, G, z, y, v) for v in vs]), rtol=1e-10)


def test_vmap_over_codes_and_tangents_names_the_function_torch_func_cannot_run():
    """A vmap that batches z too is torch.func's to run, and it cannot run this Function: mixedad says so."""
    G = around(_OldStyle)
    z, y, _ = _problem(11)
    zs, vs = torch.randn(3, *z.shape, dtype=F64), torch.randn(3, *z.shape, dtype=F64)
    with pytest.raises(RuntimeError, match=r"G calls the custom autograd.Function _OldStyle inside a torch.func "
                                           r"transform.*defines setup_context and jvp and vmap"):
        torch.func.vmap(lambda z_, v: mixedad.mixed_grad(f, G, z_, y, v))(zs, vs)


def test_a_gradient_hook_inside_g_is_honoured():
    def G(z):
        h = torch.tanh(z @ W)
        if not torch.is_grad_enabled():
            return h
        h = h * 1.0
        h.register_hook(lambda g: g.clamp(-0.3, 0.3))
        return torch.tanh(h @ W)

    z, y, v = _problem(12)
    with pytest.warns(RuntimeWarning, match="gradient hook"):
        ours = mixedad.mixed_grad(f, G, z, y, v)
    assert_close(ours, double_backward(f, G, z, y, v), rtol=1e-10)


def test_module_backward_hooks_are_honoured():
    G = torch.nn.Sequential(torch.nn.Linear(5, 5, dtype=F64), torch.nn.Tanh(), torch.nn.Linear(5, 5, dtype=F64))
    handle = G[1].register_full_backward_hook(lambda m, gi, go: (gi[0].clamp(-0.2, 0.2),))
    try:
        z, y, v = _problem(13)
        with pytest.warns(RuntimeWarning, match="backward hooks"):
            ours = mixedad.mixed_grad(f, G, z, y, v)
        assert_close(ours, double_backward(f, G, z, y, v), rtol=1e-10)
    finally:
        handle.remove()


def test_g_that_differentiates_inside_itself():
    """An energy-based G: its output is the gradient of an energy, taken inside G."""
    def G(z):
        x = z if z.requires_grad else z.detach().requires_grad_()
        energy = torch.tanh(x @ W).pow(2).sum()
        return torch.autograd.grad(energy, x, create_graph=True)[0]

    z, y, v = _problem(14)
    with pytest.warns(RuntimeWarning, match="torch.autograd.grad inside itself"):
        ours = mixedad.mixed_grad(f, G, z, y, v)
    assert_close(ours, double_backward(f, G, z, y, v), rtol=1e-10)


def test_probe_verdicts_are_cached_per_class():
    cls = clipped()
    z = torch.randn(3, dtype=F64)
    apply = cls.apply
    with torch.autograd.forward_ad.dual_level():
        x = torch.autograd.forward_ad.make_dual(z, torch.ones_like(z))
        first = _function_probes.verdict(cls, apply, (x,), {}, with_jvp=False)
        again = _function_probes.verdict(cls, lambda *a: 1 / 0, (x,), {}, with_jvp=False)  # not run again
    assert first is again and not first.linear


def test_a_run_on_meta_tensors_does_not_decide_for_real_ones():
    """Meta tensors hold no values: the probe waits for the first call with real tensors."""
    cls = _fn(lambda x: x.sin(), lambda ctx, g: g.clamp(-0.5, 0.5) * ctx.saved_tensors[0].cos(), name="ClipGradMeta")
    G = around(cls)
    z, y, v = _problem(15)
    meta = [t.to("meta") for t in (z, y, v)]
    W_meta = W.to("meta")
    G_meta = lambda x: torch.tanh(cls.apply(torch.tanh(x @ W_meta)) @ W_meta)  # noqa: E731
    assert mixedad.mixed_grad(f, G_meta, *meta).device.type == "meta"
    with pytest.warns(RuntimeWarning, match="ClipGradMeta .custom Function. has a backward that is not linear"):
        ours = mixedad.mixed_grad(f, G, z, y, v)
    assert_close(ours, double_backward(f, G, z, y, v), rtol=1e-10)
