"""Unused code in mixedad: vulture over the package, its tests, benchmarks and scripts, reporting the package's;
and pyflakes over the package (unused imports and variables, undefined names, ``__all__`` naming what is not there).

A name counts as used where any of those uses it (a test of an internal helper uses it). What
vulture cannot see is listed in ``USED_BY_TORCH_OR_REGISTRATION`` below, each with the reason:
rules registered by decorator, attributes torch reads, parameters whose names a signature fixes.
A pyflakes finding on a line marked ``noqa`` (an import for its side effect: rules that register
themselves) is left out. Exits 1 and prints the findings if there are any (``make unused``; CI
runs it).

    python scripts/unused_code.py
"""
import pathlib
import sys

import pyflakes.api
import pyflakes.reporter
import vulture

ROOT = pathlib.Path(__file__).resolve().parent.parent
PATHS = ["mixedad", "tests", "benchmarks", "scripts"]
MIN_CONFIDENCE = 60

#: (file, name): found unused by vulture, used all the same.
USED_BY_TORCH_OR_REGISTRATION = {
    ("mixedad/__init__.py", "__getattr__"): "the module's attribute hook (PEP 562): moved names",
    ("mixedad/_hooks/meta_trace.py", "nelement"): "torch.fx's tracer calls Tensor.nelement on proxies",
    ("mixedad/_hooks/meta_trace.py", "_disable_module_getattr"): "an attribute torch.fx's tracer reads",
    ("mixedad/_hooks/threads.py", "__wrapped__"): "inspect.unwrap reads it",
    ("mixedad/_planner/models.py", "_attn_implementation"): "transformers' config reads it",
    ("mixedad/_planner/target.py", "cudnn_enabled"): "torch.group_norm's signature, which the stand-in keeps",
    ("mixedad/op_rules/_attention.py", "sdpa_rule"): "registered in the rule table by its decorator",
    ("mixedad/op_rules/_formulas.py", "cdist_rule"): "registered in the rule table by its decorator",
    ("mixedad/op_rules/_formulas.py", "group_norm_rule"): "registered in the rule table by its decorator",
    ("mixedad/op_rules/_formulas.py", "memory_format_rule"): "registered in the rule table by its decorator",
    ("mixedad/op_rules/_frozen_layers.py", "convolution_rule"): "registered in the rule table by its decorator",
    ("mixedad/op_rules/_frozen_layers.py", "batch_norm_rule"): "registered in the rule table by its decorator",
}


def findings():
    """The unused code vulture finds in ``mixedad/``, less the names listed as used."""
    scan = vulture.Vulture()
    scan.scavenge([str(ROOT / p) for p in PATHS])
    found = []
    for item in scan.get_unused_code(min_confidence=MIN_CONFIDENCE):
        path = pathlib.Path(item.filename).resolve().relative_to(ROOT).as_posix()
        if path.startswith("mixedad/") and (path, item.name) not in USED_BY_TORCH_OR_REGISTRATION:
            found.append(f"{path}:{item.first_lineno}: {item.message} ({item.confidence}% confidence)")
    return found


class _Collect(pyflakes.reporter.Reporter):
    """pyflakes' findings as lines, those on ``noqa`` lines left out."""

    def __init__(self):
        super().__init__(None, None)
        self.lines = []

    def flake(self, message):
        path = pathlib.Path(message.filename).resolve()
        source = path.read_text().splitlines()
        if "noqa" not in source[message.lineno - 1]:
            self.lines.append(f"{path.relative_to(ROOT).as_posix()}:{message.lineno}: "
                              f"{message.message % message.message_args}")

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.lines.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg):
        self.lines.append(f"{filename}: {msg}")


def flakes():
    """pyflakes' findings in ``mixedad/``."""
    collect = _Collect()
    pyflakes.api.checkRecursive([str(ROOT / "mixedad")], collect)
    return collect.lines


def main():
    found = findings() + flakes()
    for line in found:
        print(line)
    print(f"unused code in mixedad/: {len(found)} finding(s)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
