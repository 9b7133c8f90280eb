"""mixedad: memory-efficient mixed-order derivatives through large frozen networks.

The public surface. Besides the functions below, the submodules ``mixedad.reference``
(double-backward ground truth), ``mixedad.op_rules`` (what
happens to each op of G: the per-op tangent rules), ``mixedad.profiling`` (exact peak memory), ``mixedad.testing``
(comparisons), ``mixedad.zoo`` (random-weight generators), ``mixedad.distributed``
(sharding latent codes across processes), ``mixedad.benchmark`` (side-by-side profiling) and
``mixedad.programs`` (the tangent programs mixedad wrote or compiled, and the per-op pass on
demand) are public. Importing mixedad needs torch and NumPy only: tqdm and matplotlib are loaded
by the benchmark functions that draw bars and plots.
"""
import warnings as _warnings

from mixedad import benchmark, distributed, op_rules, profiling, programs, reference, testing, zoo
from mixedad._ground.versions import StateChangedError
from mixedad._version import __version__
from mixedad.cached import cached_backward
from mixedad.curvature import CurvatureError, ZCurvature, z_curvature
from mixedad.graph import GraphReport, graph_report
from mixedad.implicit import implicit_argmin, implicit_grad
from mixedad.input_grad import input_grad
from mixedad.mixed import mixed_grad, mixed_jacobian
from mixedad.penalties import EagerPenalties
from mixedad.report import TangentReport, tangent_report


__all__ = [
    "CurvatureError",
    "EagerPenalties",
    "GraphReport",
    "StateChangedError",
    "TangentReport",
    "ZCurvature",
    "cached_backward",
    "graph_report",
    "implicit_argmin",
    "implicit_grad",
    "input_grad",
    "mixed_grad",
    "mixed_jacobian",
    "tangent_report",
    "z_curvature",
    "benchmark",
    "op_rules",
    "distributed",
    "profiling",
    "programs",
    "reference",
    "testing",
    "zoo",
    "__version__",
]

#: Names that moved from the top level into :mod:`mixedad.programs` (program internals, not the main surface).
_MOVED = {"CompiledTangent": "programs", "compiled_tangents": "programs", "per_op_pass": "programs"}


def __getattr__(name):
    if name in _MOVED:
        _warnings.warn(f"mixedad.{name} is now mixedad.{_MOVED[name]}.{name}; the top-level name will be removed.",
                       DeprecationWarning, stacklevel=2)
        return getattr(globals()[_MOVED[name]], name)
    raise AttributeError(f"module 'mixedad' has no attribute {name!r}")
