"""mixedad: memory-efficient mixed-order derivatives through large frozen networks.

The public surface. Besides the functions below, the submodules ``mixedad.reference``
(double-backward ground truth), ``mixedad.op_rules`` (what
happens to each op of G: the per-op tangent rules), ``mixedad.profiling`` (exact peak memory), ``mixedad.testing``
(comparisons), ``mixedad.zoo`` (random-weight generators), ``mixedad.distributed``
(sharding latent codes across processes) and ``mixedad.benchmark`` (side-by-side profiling)
are public.
"""
from mixedad import benchmark, distributed, op_rules, profiling, reference, testing, zoo
from mixedad._frontend.versions import StateChangedError
from mixedad._programs.compiled import CompiledTangent, compiled_tangents, per_op_pass
from mixedad.cached import cached_backward
from mixedad.curvature import CurvatureError, ZCurvature, z_curvature
from mixedad.graph import GraphReport, graph_report
from mixedad.implicit import implicit_argmin, implicit_grad
from mixedad.input_grad import input_grad
from mixedad.mixed import mixed_grad, mixed_jacobian
from mixedad.penalties import EagerPenalties
from mixedad.report import TangentReport, tangent_report

__version__ = "0.1.0"

__all__ = [
    "CompiledTangent",
    "CurvatureError",
    "EagerPenalties",
    "GraphReport",
    "StateChangedError",
    "TangentReport",
    "ZCurvature",
    "cached_backward",
    "compiled_tangents",
    "graph_report",
    "implicit_argmin",
    "implicit_grad",
    "input_grad",
    "mixed_grad",
    "mixed_jacobian",
    "per_op_pass",
    "tangent_report",
    "z_curvature",
    "benchmark",
    "op_rules",
    "distributed",
    "profiling",
    "reference",
    "testing",
    "zoo",
    "__version__",
]
