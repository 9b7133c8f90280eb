"""Pins for mixedad._hooks.meta_trace: the meta-carrying fx trace, Function.apply's frame, active modes."""
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mixedad._hooks import meta_trace


def _trace(module, **meta):
    seen = []
    graph = meta_trace.MetaTrace(lambda tracer, kind, target: seen.append(kind), lambda m: True).run(module, meta)
    return graph, seen


class _ReadsShapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 6)

    def forward(self, x):
        return self.linear(x).reshape(*x.shape[:-1], 2, 3).sum(-1).argmax(-1)


def test_shapes_can_be_read_and_nodes_carry_their_dtypes():
    module = _ReadsShapes()
    weight = module.linear.weight.detach().clone()
    graph, seen = _trace(module, x=torch.empty(5, 4, device="meta"))
    dtypes = {n.name: n.meta.get(meta_trace.DTYPE, "unknown") for n in graph.nodes}
    assert dtypes["linear"] == torch.float32  # a leaf module's meta value, from its own forward on meta copies
    assert dtypes["argmax"] == torch.int64
    assert "call_module" in seen and "call_method" in seen
    assert module.linear.weight.device.type == "cpu" and torch.equal(module.linear.weight, weight)


class _Doubles(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 6)

    def forward(self, x):
        return self.linear(x) * 2


def test_a_module_without_meta_leaves_its_dtype_unknown():
    graph = meta_trace.MetaTrace(lambda *a: None, lambda m: False).run(_Doubles(), {"x": torch.empty(5, 4,
                                                                                                         device="meta")})
    linear = next(n for n in graph.nodes if n.name == "linear")
    assert meta_trace.DTYPE not in linear.meta


def test_the_forward_of_a_custom_function_runs_below_apply():
    import sys

    inside = []

    def look(since):
        return meta_trace.inside_function_apply(since=since)

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            inside.append(meta_trace.inside_function_apply())
            return x

        @staticmethod
        def backward(ctx, g):
            inside.append(meta_trace.inside_function_apply())  # the engine calls backward through an apply
            inside.append(look(since=sys._getframe(0)))  # but not below this frame
            return g

    x = torch.ones(2, requires_grad=True)
    out = Probe.apply(x)
    assert inside == [True] and not meta_trace.inside_function_apply()
    out.sum().backward()
    assert inside == [True, True, False]


def test_modes_are_seen():
    assert not meta_trace.modes_active()
    with TorchFunctionMode():
        assert meta_trace.modes_active()
    assert not meta_trace.modes_active()
