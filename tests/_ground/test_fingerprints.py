"""How a value and a module class are recorded for a later comparison (program keys, saved passes' structure)."""
import types

import torch
from torch import nn

from mixedad._ground import fingerprints as fp


def test_simple_values_by_value_and_tuples_of_them_as_tuples():
    held = []
    assert fp.fingerprint(3, held) == 3 and fp.fingerprint("gelu", held) == "gelu"
    assert fp.fingerprint((1, 2), held) == (tuple, (1, 2))
    assert fp.fingerprint(torch.float32, held) == torch.float32
    assert held == []


def test_containers_and_config_objects_by_their_contents():
    held = []
    config = types.SimpleNamespace(scale=2.0, mode="a")
    same = types.SimpleNamespace(scale=2.0, mode="a")
    assert fp.fingerprint(config, held) == fp.fingerprint(same, held)
    same.scale = 3.0
    assert fp.fingerprint(config, held) != fp.fingerprint(same, held)
    assert fp.fingerprint([1, {"k": 2}], held) == (list, (1, (dict, (("k", 2),))))


def test_tensors_by_identity_and_version_unless_live_and_what_is_keyed_by_identity_is_held():
    t, held = torch.zeros(2), []
    before = fp.fingerprint(t, held)
    t.add_(1)
    assert fp.fingerprint(t, held) != before  # the version moved
    assert fp.fingerprint(t, held, live=True) == (id(t), t.dtype, t.device)
    assert all(h is t for h in held) and len(held) == 3


def test_a_class_key_sees_its_attributes_and_the_globals_its_forward_names():
    class Layer(nn.Module):
        scale = 2.0

        def forward(self, x):
            return x * self.scale * torch.pi

    held = []
    before = fp.class_key(Layer, held)
    assert fp.forward_globals(Layer)[1] == ("torch",)
    assert [c for c in fp.own_classes(Layer)] == [Layer]
    assert ("scale", 2.0) in fp.own_attributes(Layer)
    Layer.scale = 3.0
    assert fp.class_key(Layer, held) != before
