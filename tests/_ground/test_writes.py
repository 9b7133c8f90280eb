"""Which tensors an op writes in place, read from the call before it runs."""
import pytest
import torch
import torch.nn.functional as F

from mixedad._ground.writes import in_place_targets

x, y = torch.randn(3), torch.randn(3)
out = torch.empty(3)

#: (func, args, kwargs, index of the written tensor among (x, y, out), or None for no write)
CASES = {
    "method": (torch.Tensor.mul_, (x, 2.0), {}, 0),
    "function": (torch.relu_, (x,), {}, 0),
    "copy": (torch.Tensor.copy_, (x, y), {}, 0),
    "setitem": (torch.Tensor.__setitem__, (x, 0, 1.0), {}, 0),
    "augmented": (torch.Tensor.__iadd__, (x, y), {}, 0),
    "inplace keyword": (F.relu, (x,), {"inplace": True}, 0),
    "inplace by position": (F.leaky_relu, (x, 0.1, True), {}, 0),
    "dropout inplace by position": (F.dropout, (x, 0.5, False, True), {}, 0),
    "out": (torch.add, (x, y), {"out": out}, 2),
    "not in place": (F.relu, (x,), {"inplace": False}, None),
    "plain op": (torch.Tensor.mul, (x, 2.0), {}, None),
    "requires_grad_": (torch.Tensor.requires_grad_, (x,), {}, None),
    "dunder that reads": (torch.Tensor.__add__, (x, y), {}, None),
    "builtin without a signature": (torch.sin, (x,), {}, None),
}


@pytest.mark.parametrize("name", CASES)
def test_in_place_targets(name):
    func, args, kwargs, index = CASES[name]
    targets = in_place_targets(func, args, kwargs)
    if index is None:
        assert targets == []
    else:
        assert len(targets) == 1 and targets[0] is (x, y, out)[index]


def test_every_tensor_of_an_out_tuple_is_written():
    values, indices = torch.empty(2), torch.empty(2, dtype=torch.long)
    targets = in_place_targets(torch.max, (torch.randn(2, 3), 1), {"out": (values, indices)})
    assert targets[0] is values and targets[1] is indices
