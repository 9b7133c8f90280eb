"""What a callable G holds, found without running it: modules and random sources in closures, globals, objects."""
import functools
import random

import pytest
import torch
from torch import nn

from mixedad._ground.reach import modules_reached, reached


class _Holder:
    def __init__(self, net):
        self.net = net

    def __call__(self, z):
        return self.net(z)

    def run(self, z):
        return self.net(z)


NET = nn.Sequential(nn.Linear(2, 2), nn.Tanh())


def _global_g(z):
    return NET(z)


def _with_default(z, net=NET):
    return net(z)


LAYERS = {"net": [NET]}


def _in_a_container(z):
    return LAYERS["net"][0](z)


@pytest.mark.parametrize("G", [NET, lambda z: NET(z), _global_g, _with_default, _in_a_container, _Holder(NET),
                               _Holder(NET).run, functools.partial(lambda net, z: net(z), NET)],
                         ids=["module", "closure", "global", "default", "container", "callable object", "bound method",
                              "partial"])
def test_modules_reached_finds_the_modules_a_callable_holds(G):
    assert modules_reached(G) == list(NET.modules())


def test_modules_reached_finds_nothing_in_a_plain_function():
    assert modules_reached(lambda z: z * 2) == []


def test_reached_lists_the_random_sources_a_function_closes_over():
    gen, rng = torch.Generator(), random.Random(0)
    found = reached(lambda z: z * torch.rand(1, generator=gen) * rng.random())
    assert any(obj is gen for obj in found) and any(obj is rng for obj in found)
