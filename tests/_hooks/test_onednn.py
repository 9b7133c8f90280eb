"""Pins for mixedad._hooks.onednn: oneDNN's linear kernel, where present, computes F.linear."""
import torch
import torch.nn.functional as F

from mixedad._hooks.onednn import onednn_linear_op


def test_the_kernel_is_none_or_linear():
    op = onednn_linear_op()
    if op is None:
        return  # this build has none: the tangent takes F.linear, which the rule tests cover
    x, w = torch.randn(4, 3), torch.randn(5, 3)
    assert torch.allclose(op(x, w, None, "none", [], ""), F.linear(x, w), rtol=1e-5, atol=1e-6)
