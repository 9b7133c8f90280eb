"""Tangent programs, for users who look inside them: what was written or compiled, and the per-op pass on demand.

mixedad's default writes G's tangent program (one graph that computes G(z) and its tangent
together) for an ``nn.Sequential`` chain of ``torch.nn`` layers from the third call with the same
inputs' layouts, and ``compile=True`` compiles it (:mod:`mixedad._programs`). Both are checked
against the per-op pass before they are trusted. This module holds what a user may want of them:

- :func:`compiled_tangents`: the programs kept for G, each a :class:`CompiledTangent` with its
  status, the reason for a fallback, compile times and the difference measured at its check;
- :func:`per_op_pass`: a block inside which every call runs mixedad's per-op pass, never a program
  (to compare the two routes, or to rule a program out).

Example:
    >>> import torch, mixedad
    >>> G = mixedad.zoo.mlp(depth=2, width=4)
    >>> z, v, y = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    >>> with mixedad.programs.per_op_pass():
    ...     g = mixedad.mixed_grad(lambda y, x: ((x - y) ** 2).sum(), G, z, y, v)
    >>> mixedad.programs.compiled_tangents(G)
    []
"""
from mixedad._programs.cache import CompiledTangent, compiled_tangents, per_op_pass

__all__ = ["CompiledTangent", "compiled_tangents", "per_op_pass"]
