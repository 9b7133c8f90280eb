r"""z-space curvature through a frozen G: the pieces behind :mod:`mixedad.curvature` and :mod:`mixedad.implicit`.

- :mod:`mixedad._curvature.segments`: G as a chain of segments :math:`G = S_n \circ \cdots \circ
  S_1`, with the sweeps that give :math:`J^\top w` and the exact Hessian product one segment at a
  time (each segment's graph is recomputed and freed before the next).
- :mod:`mixedad._curvature.cg`: conjugate gradients on tensors with z's structure.
"""
