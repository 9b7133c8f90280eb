"""Pins for mixedad._hooks.functorch: transform levels, interpreters and wrapped tensors."""
import torch

from mixedad._hooks import functorch as hook


def test_levels_and_interpreters():
    assert hook.current_level() is None and not hook.in_functorch_transform()
    seen = {}

    def body(x):
        seen["level"] = hook.current_level()
        seen["vmap"], seen["grad"] = hook.under_vmap(), hook.under_differentiating_transform()
        return x.sin()

    torch.func.vmap(body)(torch.randn(3, 2))
    assert isinstance(seen["level"], int) and seen["vmap"] and not seen["grad"]
    torch.func.jvp(body, (torch.randn(2),), (torch.randn(2),))
    assert seen["grad"] and not seen["vmap"]


def test_wrapped_tensors_are_the_transforms_own_and_captured_ones_are_not():
    captured = torch.zeros(2)
    seen = {}

    def body(x):
        seen["x"], seen["captured"], seen["made"] = hook.is_wrapped(x), hook.is_wrapped(captured), hook.is_wrapped(torch.ones(2))
        return x

    torch.func.jvp(body, (torch.randn(2),), (torch.randn(2),))
    assert seen == {"x": True, "captured": False, "made": True}


def test_tangent_batch_pushes_k_tangents_with_the_primal_once():
    batch = hook.TangentBatch()
    z, vs = torch.randn(3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    seen = []

    def fn(x):
        seen.append((hook.current_level() == batch.jvp_level, batch.active()))
        return (x.sin() * 2,)

    out, out_tangents = batch.push(fn, [z], [vs])
    assert seen == [(True, True)]  # G ran once, at the batch's jvp
    assert torch.equal(out[0], z.sin() * 2) and not hook.is_wrapped(out[0])
    assert torch.allclose(out_tangents[0], vs * z.cos() * 2, rtol=1e-14)
    assert not batch.active() and hook.current_level() is None


def test_lowering_gives_plain_tensors_and_lifting_takes_them_back():
    """What a rule that needs plain autograd does: lower, compute outside the transforms, lift."""
    batch = hook.TangentBatch()
    z, vs = torch.randn(3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)

    def fn(x):
        primal, tangent = torch._unpack_dual(x, torch.autograd.forward_ad._current_level)
        plain = batch.lower_primal(primal)
        lowered = batch.lower_tangent(tangent, plain)
        assert not hook.is_wrapped(plain) and not hook.is_wrapped(lowered) and lowered.shape == (4, 3)
        with batch.plain():
            assert hook.current_level() is None
            base = plain.detach().requires_grad_()  # plain autograd works here
            (pulled,) = torch.autograd.grad(base.exp().sum(), base)
            out_tangent = lowered * pulled
        assert hook.current_level() == batch.jvp_level  # the stack is back
        return (batch.lift(pulled.detach(), out_tangent) * 3,)

    out, out_tangents = batch.push(fn, [z], [vs])
    assert torch.allclose(out[0], 3 * z.exp()) and torch.allclose(out_tangents[0], 3 * vs * z.exp())


def test_plain_restores_the_transforms_after_an_error():
    def body(x):
        try:
            with hook.TangentBatch.plain():
                raise KeyError("inside")
        except KeyError:
            pass
        assert hook.current_level() is not None
        return x

    torch.func.vmap(body)(torch.randn(2, 3))


def test_a_primal_that_depends_on_an_outer_transform_is_not_lowerable():
    import pytest

    z, vs = torch.randn(3), torch.randn(2, 3)

    def body(scale):
        return hook.TangentBatch().push(lambda x: (x * scale,), [z], [vs])[0][0]

    with pytest.raises(hook.NotLowerable):
        torch.func.vmap(body)(torch.rand(4))


def test_tangents_of_the_innermost_vmap():
    z = torch.randn(3)
    assert hook.tangents_of_innermost_vmap([torch.randn(3)], [z]) is None  # outside every transform
    found = {}

    def body(v, w, code):
        found["tangents"] = hook.tangents_of_innermost_vmap([v, w], [z])
        found["with a batched code"] = hook.tangents_of_innermost_vmap([v], [code])
        found["nothing batched"] = hook.tangents_of_innermost_vmap([z], [z])
        return v

    vs, w, codes = torch.randn(3, 4), torch.randn(3), torch.randn(4, 3)
    torch.func.vmap(body, in_dims=(1, None, 0))(vs, w, codes)
    level, (lowered_v, lowered_w) = found["tangents"]
    assert isinstance(level, int) and torch.equal(lowered_v, vs.T) and torch.equal(lowered_w, w.expand(4, 3))
    assert found["with a batched code"] is None and found["nothing batched"] is None


def test_batched_at_makes_a_plain_tensor_batched_at_a_level():
    def body(v):
        level = hook.current_level()
        return v + hook.batched_at(torch.arange(3.0)[:, None].expand(3, 2), level)

    assert torch.equal(torch.func.vmap(body)(torch.zeros(3, 2)), torch.arange(3.0)[:, None].expand(3, 2))


def test_plain_example_is_the_first_example_under_every_transform():
    seen = {}

    def inner(x):
        seen["example"] = hook.plain_example(x)
        return x

    def outer(xs):
        return torch.func.vmap(inner, in_dims=1)(xs)

    data = torch.arange(24.0).reshape(2, 3, 4)
    torch.func.vmap(outer)(data)
    assert not hook.is_wrapped(seen["example"]) and torch.equal(seen["example"], data[0][:, 0])
    torch.func.jvp(inner, (torch.ones(3),), (torch.zeros(3),))
    assert torch.equal(seen["example"], torch.ones(3)) and not hook.is_wrapped(seen["example"])
