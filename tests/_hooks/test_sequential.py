"""Pins for mixedad._hooks.sequential: the running child of an nn.Sequential, and forward hooks."""
import torch
from torch import nn

from mixedad._hooks.sequential import forward_hooks, running_child


class Probe(nn.Module):
    """Records what running_child sees from inside its forward (a few frames down, as a rule is)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(self._deeper())
        return x

    def _deeper(self):
        return running_child()


def test_the_running_child_of_the_innermost_sequential():
    probe = Probe()
    inner = nn.Sequential(nn.Identity(), probe)
    outer = nn.Sequential(inner, nn.Identity())
    outer(torch.ones(2))
    assert probe.seen == [(inner, probe)]


def test_nothing_outside_a_sequential():
    probe = Probe()
    probe(torch.ones(2))
    assert probe.seen == [None]


def test_forward_hooks_of_modules_and_global_ones():
    a, b = nn.Identity(), nn.Identity()
    assert not forward_hooks(a, b)
    handle = b.register_forward_pre_hook(lambda m, x: None)
    assert forward_hooks(a, b)
    handle.remove()
    handle = a.register_forward_hook(lambda m, x, y: None)
    assert forward_hooks(a, b)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda m, x, y: None)
    try:
        assert forward_hooks(a, b)
    finally:
        handle.remove()
    handle = nn.modules.module.register_module_forward_pre_hook(lambda m, x: None)
    try:
        assert forward_hooks(a, b)
    finally:
        handle.remove()
    assert not forward_hooks(a, b)


def test_reading_the_running_child_keeps_no_input_alive():
    """Before Python 3.13 a frame keeps its f_locals snapshot: it must not hold the Sequential's input."""
    import gc
    import weakref

    seen = []

    class Make(nn.Module):
        def forward(self, x):
            return x * 2  # an intermediate only the Sequential's `input` refers to

    class Read(nn.Module):
        def forward(self, x):
            running_child()
            seen.append(weakref.ref(x))
            return x + 1  # the Sequential's `input` moves on

    class Check(nn.Module):
        def forward(self, x):
            gc.collect()
            assert seen[0]() is None, "the intermediate is still alive"
            return x

    nn.Sequential(Make(), Read(), Check())(torch.ones(3))
