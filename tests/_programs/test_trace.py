"""What a trace refuses, so that no program differs from what G computes; and G left as found."""
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixedad._hooks import meta_trace
from mixedad._programs.program import write
from mixedad._programs.rules import Unsupported
from mixedad._programs.trace import trace


class _Wrap(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.fn = fn

    def forward(self, z):
        return self.fn(self, z)


class _Clip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g.clamp(-0.1, 0.1)  # an odd backward: the meaning, which a trace never sees


def _no_grad_block(self, z):
    with torch.no_grad():
        h = self.linear(z)
    return h + z


def _autocast_block(self, z):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = self.linear(z)
    return h.float()


def _values_read(self, z):
    return self.linear(z) if z.sum() > 0 else -z


def _alias_written(self, z):
    h = self.linear(z)
    alias = h
    alias += 1  # changes h in eager code; a trace would record a new tensor and leave h alone
    return h * 2


REFUSED = {
    "augmented_assignment_on_an_alias": (_alias_written, "augmented assignment"),
    "no_grad": (_no_grad_block, "grad mode"),
    "autocast": (_autocast_block, "autocast"),
    "custom_function": (lambda self, z: _Clip.apply(self.linear(z)), "custom torch.autograd.Function"),
    "values_read": (_values_read, "cannot trace"),
    "noise": (lambda self, z: self.linear(z) + torch.randn(z.shape), "random"),
    "noise_from_a_generator": (lambda self, z: self.linear(z) + torch.randn(z.shape, generator=torch.Generator()),
                               "random"),
    "dropout": (lambda self, z: F.dropout(self.linear(z), 0.5, training=True), "random"),
    "in_place_on_a_reused_tensor": (lambda self, z: torch.relu_(self.linear(z)) + z, "in place"),
    "no_rule": (lambda self, z: torch.cumsum(self.linear(z), 0), "cumsum"),
    "attention_dropout": (lambda self, z: F.scaled_dot_product_attention(*(self.linear(z)[None, None],) * 3,
                                                                         dropout_p=0.1), "dropout"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_a_trace_cannot_see_is_refused(case):
    fn, message = REFUSED[case]
    G = _Wrap(fn)
    z = torch.randn(2, 3)
    rng = torch.get_rng_state()
    call, grad = nn.Module.__call__, torch.is_grad_enabled()
    with pytest.raises(Unsupported, match=message):
        write(G, [z])
    assert torch.equal(torch.get_rng_state(), rng)
    # torch as found: no mode left on the stack, torch.fx's patches undone, grad mode unchanged
    assert not meta_trace.modes_active() and nn.Module.__call__ is call and torch.is_grad_enabled() == grad


def test_eval_dropout_is_no_draw():
    G = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)).eval()
    write(G, [torch.randn(2, 3)])
    with pytest.raises(Unsupported, match="random"):
        write(G.train(), [torch.randn(2, 3)])


def test_hooks_and_replaced_forwards_are_refused():
    G = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    handle = G[0].register_forward_hook(lambda *a: None)
    with pytest.raises(Unsupported, match="hooks"):
        trace(G, [torch.randn(2, 3)])
    handle.remove()
    G[1].forward = lambda x: x
    with pytest.raises(Unsupported, match="replaced"):
        trace(G, [torch.randn(2, 3)])


def test_only_modules_with_named_inputs_are_traced():
    with pytest.raises(Unsupported, match="nn.Module"):
        trace(lambda z: z * 2, [torch.randn(2)])

    class Star(nn.Module):
        def forward(self, *zs):
            return zs[0]

    with pytest.raises(Unsupported, match="positional inputs"):
        trace(Star(), [torch.randn(2)])


def test_a_trace_leaves_buffers_and_attributes_as_found():
    G = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).train()
    before = {k: b.clone() for k, b in G.state_dict().items()}
    trace(G, [torch.randn(5, 3)])
    assert all(torch.equal(before[k], b) for k, b in G.state_dict().items())
    assert all(p.device.type == "cpu" for p in G.parameters())


def test_shapes_are_fixed_by_the_trace():
    class Reshape(nn.Module):
        def forward(self, z):
            return z.reshape(*z.shape[:-1], 2, 2)

    traced = trace(Reshape(), [torch.randn(3, 4)])
    assert "reshape(3, 2, 2)" in traced.code


def test_a_program_does_not_keep_g_alive():
    import gc
    import weakref

    G = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    program = write(G, [torch.randn(2, 3)])
    ref = weakref.ref(G)
    del G, program
    gc.collect()
    assert ref() is None


def test_in_place_functions_of_every_spelling_are_refused():
    """Found by a review: F.leaky_relu_ (torch._C._nn's) and torch.ops.aten.hardtanh_ slipped through, and a
    program kept the old tangent (23.6 off where the first call's inputs kept the clamp inactive)."""
    for spelling in (F.leaky_relu_, F.hardtanh_, F.elu_, torch.ops.aten.hardtanh_, torch.ops.aten.hardtanh_.default):
        class InPlace(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(3, 3)

            def forward(self, z):
                h = self.lin(z)
                spelling(h)
                return h * 2

        with pytest.raises(Unsupported, match="writes in place"):
            write(InPlace(), [torch.randn(2, 3)])


def test_a_list_the_forward_appends_to_is_refused_and_keeps_no_proxy():
    """Found by a review: the trace left its proxy in the user's list, and re-traced on every call."""
    class Collects(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.feats, self.seen = nn.Linear(3, 3), [], {}

        def forward(self, z):
            h = self.lin(z)
            self.feats.append(h)
            self.seen[len(self.seen)] = random.random()  # a Python draw too
            return h

    G = Collects()
    G.feats.append(torch.ones(1))
    state = random.getstate()
    with pytest.raises(Unsupported, match="changes the attribute Collects.feats"):
        write(G, [torch.randn(2, 3)])
    assert len(G.feats) == 1 and type(G.feats[0]) is torch.Tensor and G.seen == {}
    assert random.getstate() == state
