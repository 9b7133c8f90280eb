"""What a tangent program is written for (mixedad._programs.key): which changes give another key, and which do not."""
import gc
import weakref

import torch
from torch import nn

from mixedad._programs.key import key_of

SCALE = 2.0


class _Scaled(nn.Module):
    factor = 1.5

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.options = {"shift": 0.0, "sizes": (1, 2)}
        self.kind = [1, 2]
        self.fn = None

    def forward(self, z):
        return self.lin(z) * SCALE * self.factor


def _key(G, z, v=None, batch=0):
    return key_of(G, [z], [z if v is None else v], batch)[0]


def test_the_same_G_and_inputs_give_the_same_key_call_after_call():
    G, z = _Scaled(), torch.randn(4, 3)
    assert _key(G, z) == _key(G, z) == _key(G, z.clone())


def test_inputs_layouts_dtype_and_batch_give_other_keys():
    G, z = _Scaled(), torch.randn(4, 3)
    base = _key(G, z)
    assert _key(G, torch.randn(5, 3)) != base
    assert _key(G, torch.randn(3, 4).mT) != base  # strides
    assert _key(G, z.double()) != base
    assert _key(G, z, batch=2) != base


def test_every_kind_of_module_state_gives_another_key():
    G, z = _Scaled(), torch.randn(4, 3)
    base = _key(G, z)
    changes = [
        lambda: G.lin.train(False),
        lambda: setattr(G.lin, "in_features", 3.0),  # a number by value: 3.0 == 3, but another type
        lambda: G.options.__setitem__("shift", 1.0),  # a container's contents
        lambda: G.options.__setitem__("sizes", [1, 2]),  # a tuple and a list of the same numbers differ
        lambda: setattr(G, "kind", (1, 2)),
        lambda: setattr(G, "fn", torch.tanh),  # anything else by identity
        lambda: setattr(G.lin, "weight", nn.Parameter(G.lin.weight.detach().clone())),  # another tensor
        lambda: setattr(type(G), "factor", 3.0),  # a class attribute
        lambda: globals().__setitem__("SCALE", 3.0),  # a global forward names
    ]
    undo = [
        lambda: G.lin.train(True), lambda: setattr(G.lin, "in_features", 3),
        lambda: G.options.__setitem__("shift", 0.0), lambda: G.options.__setitem__("sizes", (1, 2)),
        lambda: setattr(G, "kind", [1, 2]), lambda: setattr(G, "fn", None), lambda: None,
        lambda: setattr(type(G), "factor", 1.5), lambda: globals().__setitem__("SCALE", 2.0),
    ]
    for i, (change, back) in enumerate(zip(changes, undo)):
        change()
        assert _key(G, z) != base, i
        back()
        base = _key(G, z)  # the replaced weight stays replaced


def test_weights_changed_in_place_keep_the_key_a_program_reads_them_live():
    G, z = _Scaled(), torch.randn(4, 3)
    base = _key(G, z)
    with torch.no_grad():
        G.lin.weight.mul_(2)
    assert _key(G, z) == base


def test_a_plain_tensor_attribute_is_keyed_by_its_version():
    G, z = _Scaled(), torch.randn(4, 3)
    G.offset = torch.zeros(3)
    base = _key(G, z)
    G.offset.add_(1)  # a traced program would have kept its old value as a constant
    assert _key(G, z) != base


def test_what_the_key_identifies_by_id_is_held_alive():
    G, z = _Scaled(), torch.randn(4, 3)
    G.fn = lambda x: x
    ref = weakref.ref(G.fn)
    key, held = key_of(G, [z], [z], 0)
    G.fn = None
    gc.collect()
    assert ref() is not None and any(h is ref() for h in held)
    del held
    gc.collect()
    assert ref() is None
