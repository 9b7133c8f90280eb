"""Tensors that hold no values, and tensors whose elements share memory.

What this relies on in torch (pinned by ``tests/_hooks/test_tensor_kinds.py``):

- ``torch._subclasses.fake_tensor.is_fake(t)`` tells a FakeTensor (torch.compile's tracing, the
  memory planner's fake mode) from a real one; meta tensors have ``device.type == "meta"``;
- ``torch._debug_has_internal_overlap(t)`` returns 1 when some elements of ``t`` share memory
  (``expand``), which dual tensors refuse;
- ``t.untyped_storage()._cdata`` identifies the storage ``t`` views, on every device, meta included
  (where ``data_ptr()`` is 0 for all): views of one tensor share it, a clone does not.
"""
import torch


def holds_values(t):
    """Whether ``t`` holds values: not a meta tensor, not a fake tensor."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


def shares_memory_within(t):
    """Whether some elements of ``t`` share memory (an expanded tensor)."""
    return torch._debug_has_internal_overlap(t) == 1


def storage_id(t):
    """The identity of the storage ``t`` views (shared by its views; meta tensors too)."""
    return t.untyped_storage()._cdata
