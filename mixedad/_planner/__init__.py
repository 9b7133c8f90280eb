r"""Memory: exact storage counts and plans on meta tensors, behind :mod:`mixedad.profiling` (their public face).

- :mod:`mixedad._planner.storage`: :class:`~mixedad.profiling.StorageCounter`, the exact count of
  live storage bytes that CPU peaks and plans both take.
- :mod:`mixedad._planner.plan`: :func:`~mixedad.profiling.plan` and :class:`~mixedad.profiling.Plan`,
  each method's peak from one run on meta tensors, and the generators planned at real sizes
  (:func:`~mixedad.profiling.plan_model`).
- :mod:`mixedad._planner.meta`: meta copies of G, z and y (G's parameters and buffers swapped for
  meta tensors of the same sizes for the call; G itself untouched), and :class:`PlanError` for
  what cannot run on meta.
- :mod:`mixedad._planner.target`: the kernel choices of the target device, emulated on meta
  (fused attention, the CPU's group norm).
- :mod:`mixedad._planner.layouts`: the layouts the target device's kernels give their outputs
  (convolutions on the CPU and with cuDNN; group norm, pixel shuffle and pads on the CPU).
- :mod:`mixedad._planner.models`: the generators ``python -m mixedad plan`` builds at real sizes.
"""
