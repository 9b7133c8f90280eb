"""The meta computation inside PyTorch's kernels for storage-free zero tensors, which allocates nothing on a device.

Forward AD gives an input without a tangent an efficient zero tensor (``torch._efficientzerotensor``: no storage)
as its tangent. The ``ZeroTensor`` dispatch key runs before a dispatch mode sees an op, and its kernels (``add``,
``mul``, ...) find the output's size and dtype by running the op's meta kernel on meta copies of their inputs,
reached directly (``redispatch`` to ``Meta``), not through the mode. Where that meta kernel is one of PyTorch's
Python references, the primitives it calls (``torch.ops.prims``) go through the dispatcher, and a dispatch mode
sees them. On a device those tensors are meta tensors, which a byte counter skips; in a plan every tensor is a
meta tensor, and counting them counted meta results as if the device held them, over-planning a fused modulated
convolution (docs/performance.md, "Measurements behind the design").

What this relies on in torch (pinned by ``tests/_hooks/test_zero_tensors.py``): a dispatch mode sees ops of the
``prims`` namespace only inside such a meta kernel: a device run of the same code returns only meta tensors from
them (mixedad's own passes, and the ops G calls, reach the mode as ``aten`` ops, whose meta kernels run inside the
mode's handler, unseen).
"""

__all__ = ["inside_meta_kernel"]


def inside_meta_kernel(func):
    """Whether an op a dispatch mode sees is a primitive of a Python meta kernel that a device kernel ran."""
    return func.namespace == "prims"
