"""Module and class structures a saved pass replays: recorded once, and whether they still hold, quick or exact."""
import types

import pytest
import torch
from torch import nn

from mixedad._ground.structure import ClassStructure, Structure, structure_of

SCALE = 2.0


class _Config:
    def __init__(self):
        self.width = 3


class Scaled(nn.Module):
    """Reads a module global, a class attribute and a configuration object."""

    offset = 0.5

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.sizes = [1, 2]
        self.config = _Config()
        self.cache = torch.zeros(4)

    def forward(self, x):
        return self.lin(x) * SCALE + self.offset


def _hook(module, args, out):
    return out


CHANGES = {
    "a configuration tuple": lambda m: setattr(m.lin, "some_tuple", (1, 2)),
    "a list in place": lambda m: m.sizes.append(3),
    "a configuration object in place": lambda m: setattr(m.config, "width", 4),
    "a child replaced": lambda m: setattr(m, "lin", nn.Linear(3, 3)),
    "a hook added": lambda m: m.register_forward_hook(_hook),
    "a method on the instance": lambda m: setattr(m, "extra", types.MethodType(lambda self: 1, m)),
    "an attribute removed": lambda m: delattr(m, "sizes"),
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_a_change_no_snapshot_replays_is_found(change):
    module = Scaled()
    records = [Structure(m, []) for m in module.modules()]
    assert all(r.holds() for r in records)
    change(module)
    assert not all(r.holds() for r in records)


def test_a_hook_removed_and_another_added_is_found():
    module = Scaled()
    handle = module.register_forward_hook(_hook)
    record = Structure(module, [])
    handle.remove()
    module.register_forward_hook(_hook)
    assert not record.holds()


REPLAYED = {
    "the mode": lambda m: m.train(False),
    "a number": lambda m: setattr(m, "steps", 3),
    "a tensor replaced": lambda m: setattr(m, "cache", torch.ones(4)),  # its == is no truth value
}


@pytest.mark.parametrize("change", REPLAYED.values(), ids=REPLAYED.keys())
def test_what_snapshots_replay_leaves_the_structure_holding(change):
    module = Scaled()
    record = Structure(module, [])
    change(module)
    assert not record.namespace.same(vars(module))  # the quick test fails, the exact one decides
    assert record.holds()


def test_the_quick_test_answers_an_unchanged_module_without_the_exact_key():
    module = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    records = [Structure(m, []) for m in module.modules()]
    assert all(r.key is None and r.namespace.same(vars(r.module)) for r in records)  # the copies stand for the dicts
    assert structure_of(module, [], records[0].namespace.copy) == structure_of(module, [])


def test_a_configuration_object_is_keyed_when_recorded():
    module = Scaled()
    record = Structure(module, [])
    assert record.namespace.deep and record.key is not None  # a shallow copy would share the object
    module.config = _Config()  # another object, equal contents: the same structure
    assert record.holds()
    module.config.width = 4
    assert not record.holds()


def test_a_class_attribute_or_a_global_forward_names_is_found():
    global SCALE
    Own = type("Own", (Scaled,), {})
    record = ClassStructure(Own, [])
    assert record.holds()
    Own.offset = 1.5
    assert not record.holds()
    del Own.offset  # inherited again
    assert record.holds()
    before = SCALE
    try:
        SCALE = 3.0
        assert not record.holds()
    finally:
        SCALE = before
    assert record.holds()
