"""The rule table: what has a rule, and the refusals a rule makes rather than guess."""
import operator

import pytest
import torch
import torch.fx as fx
from torch import nn

from mixedad._programs import rules
from mixedad._programs.program import write
from mixedad._programs.rules import Unsupported


class _Fn(nn.Module):
    def __init__(self, fn, *modules):
        super().__init__()
        self.fn = fn
        self.layers = nn.ModuleList(modules)

    def forward(self, z):
        return self.fn(self, z)


REFUSALS = {
    "output_size": (lambda s, z: s.layers[0](z, output_size=[5, 5]), [nn.ConvTranspose2d(2, 2, 3, stride=2)],
                    (1, 2, 2, 2), "output_size"),
    "alpha": (lambda s, z: torch.add(z, z, alpha=2.0), [], (3,), "alpha"),
    "tensor_exponent": (lambda s, z: z ** z, [], (3,), "exponent"),
    "in_place_activation_reused": (lambda s, z: s.layers[0](z * 1) + s.layers[1](z * 1)
                                   if False else (lambda h: s.layers[0](h) + h)(z * 1),
                                   [nn.ReLU(inplace=True), nn.Identity()], (3,), "in place"),
    "instance_norm_running_stats": (lambda s, z: s.layers[0](z), [nn.InstanceNorm1d(2, track_running_stats=True).eval()],
                                    (2, 2, 3), "running statistics"),
    "tangent_in_a_shape_argument": (lambda s, z: z.expand_as(z * 2), [], (3,), "other than its input"),
    "unknown_attribute": (lambda s, z: z.real, [], (3,), "attribute"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_rule_refuses_rather_than_guesses(case):
    fn, modules, shape, message = REFUSALS[case]
    with pytest.raises(Unsupported, match=message):
        write(_Fn(fn, *modules), [torch.randn(shape)])


def test_carries_sees_nodes_and_missing_tangents_anywhere():
    graph = fx.Graph()
    node = graph.placeholder("x")
    assert rules.carries(node) and rules.carries([1, (2, node)]) and rules.carries({"a": slice(None, node)})
    assert rules.carries(rules.Missing("why"))
    assert not rules.carries((None, 3, slice(None), {"a": None}))


def test_every_module_rule_is_for_an_exact_torch_class():
    assert all(cls.__module__.startswith("torch.nn") for cls in rules.MODULES)
    assert nn.Linear in rules.MODULES and nn.BatchNorm2d in rules.MODULES and nn.MultiheadAttention not in rules.MODULES
    assert operator.getitem in rules.FUNCTIONS and torch.cumsum not in rules.FUNCTIONS


def test_a_subclass_of_a_layer_is_not_taken_for_the_layer():
    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 3

    G = _Fn(lambda s, z: s.layers[0](z), Scaled(3, 3))
    from tests._programs.common import assert_program_matches
    assert_program_matches(G.double(), torch.randn(2, 3, dtype=torch.float64))  # traced through, as F.linear
