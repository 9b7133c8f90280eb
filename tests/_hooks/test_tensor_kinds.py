"""Pins for mixedad._hooks.tensor_kinds: fake and meta tensors hold no values; expanded tensors share memory."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mixedad._hooks import tensor_kinds as hook


def test_values_and_shared_memory():
    assert hook.holds_values(torch.ones(2))
    assert not hook.holds_values(torch.ones(2, device="meta"))
    with FakeTensorMode():
        fake = torch.ones(2)
    assert not hook.holds_values(fake)
    assert hook.shares_memory_within(torch.ones(1).expand(3))
    assert not hook.shares_memory_within(torch.ones(3))


def test_storage_identity_follows_views_on_every_device():
    for device in ("cpu", "meta"):
        x = torch.ones(4, 3, device=device)
        assert hook.storage_id(x.t()) == hook.storage_id(x) == hook.storage_id(x[1:].view(-1))
        assert hook.storage_id(x.clone()) != hook.storage_id(x)
        assert hook.storage_id(torch.ones(2, device=device)) != hook.storage_id(x)
