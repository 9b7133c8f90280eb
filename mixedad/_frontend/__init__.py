"""The front end: the tangent pass that computes ``G(z)`` and ``J_G(z) v`` together.

- :mod:`~mixedad._frontend.tangents`: :func:`push_tangent`, the forward pass through the op
  rules, the route to a tangent program where one holds, and the whole-G fallback when the
  forward pass cannot go on;
- :mod:`~mixedad._frontend.batched`: a batch of tangents in one pass.

What the pass stands on (grad mode, state and its replay, nesting, errors, the pass lock) is in
:mod:`mixedad._ground`.
"""
