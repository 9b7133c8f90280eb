"""The front end: the tangent pass that computes ``G(z)`` and ``J_G(z) v`` together.

- :mod:`~mixedad._frontend.tangents`: :func:`push_tangent`, the forward pass through the op
  rules, and the whole-G fallback when the forward pass cannot go on;
- :mod:`~mixedad._frontend.grad_mode`: grad mode read from torch at each op;
- :mod:`~mixedad._frontend.state`: snapshots of G's random state and buffers, for replays;
- :mod:`~mixedad._frontend.nesting`: one pass at a time per thread.
"""
