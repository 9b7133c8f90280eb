"""mixedad: memory-efficient mixed-order derivatives through large frozen networks.

The public surface. Besides the functions below, the submodules ``mixedad.reference``
(double-backward ground truth), ``mixedad.profiling`` (exact peak memory), ``mixedad.testing``
(comparisons) and ``mixedad.zoo`` (random-weight generators) are public.
"""
from mixedad import profiling, reference, testing, zoo
from mixedad.mixed import mixed_grad

__version__ = "0.1.0"

__all__ = ["mixed_grad", "profiling", "reference", "testing", "zoo", "__version__"]
