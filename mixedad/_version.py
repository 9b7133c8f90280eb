"""mixedad's version, in one place: the package's face, setup.cfg and the benchmarks' records read it."""
__version__ = "0.1.0"
