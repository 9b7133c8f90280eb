"""Sphinx configuration for mixedad's documentation site (``make docs``)."""
import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import mixedad  # noqa: E402
from mixedad.op_rules import PATHS, TABLE, op_name  # noqa: E402

project = "mixedad"
author = "mixedad's maintainers"
release = version = mixedad.__version__
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_nb",
]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb", ".rst": "restructuredtext"}
myst_enable_extensions = ["dollarmath", "amsmath"]
nb_execution_mode = "off"  # the notebooks are run by make test (nbmake); the site shows them as stored
html_theme = "furo"
html_title = f"mixedad {release}"
exclude_patterns = ["_build", "_generated"]  # _generated/ is included into pages, not a page itself
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "undoc-members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields, not a second description of each attribute
myst_heading_anchors = 3


def _label(path):
    """A path's label: PATHS holds str Enum members (or plain strings)."""
    return str(path.value) if hasattr(path, "value") else str(path)


def _op_paths_table():
    """The op-paths table, generated from mixedad.op_rules: docs and code cannot drift apart."""
    ops = {}
    for func, rule in TABLE.items():
        ops.setdefault(_label(rule.path), set()).add(op_name(func))
    rows = ["| path | what it does | ops in the table |", "|---|---|---|"]
    for path in PATHS:
        label = _label(path)
        names = ", ".join(f"`{n}`" for n in sorted(ops.get(label, ()))) or "(decided at run time)"
        rows.append(f"| `{label}` | {getattr(path, 'description', '')} | {names} |")
    return "\n".join(rows) + "\n"


def _program_coverage():
    """What a tangent program covers, generated from the programs' tables (mixedad._programs.rules)."""
    from mixedad._programs.rules import FUNCTIONS, METHODS, MODULES

    def names(items):
        return ", ".join(f"`{n}`" for n in sorted(set(items)))

    layers = names(f"nn.{cls.__name__}" for cls in MODULES)
    functions = names(op_name(fn) if not getattr(fn, "__module__", "") == "_operator" else f"operator.{fn.__name__}"
                      for fn in FUNCTIONS)
    methods = names(f"Tensor.{name}" for name in METHODS)
    return (f"- **Layers** ({len(set(MODULES))}): {layers}\n"
            f"- **Functions** ({len(set(FUNCTIONS))}): {functions}\n"
            f"- **Tensor methods** ({len(set(METHODS))}): {methods}\n")


def _generate(app):
    generated = HERE / "_generated"
    generated.mkdir(exist_ok=True)
    (generated / "op_paths_table.md").write_text(_op_paths_table())
    (generated / "program_coverage.md").write_text(_program_coverage())
    # The benchmarks' tables, as their scripts last wrote them (tangent_speed.py, attention_vs_length.py,
    # many_tangents.py, jax_compare.py, float32_kinks.py): never copied by hand, so never stale.
    for table in ("tangent_speed_cpu.md", "attention_cpu.md", "many_tangents_cpu.md", "jax_compare_cpu.md",
                  "float32_kinks_cpu.md"):
        shutil.copyfile(HERE.parent / "benchmarks" / "results" / table, generated / table)
    notebooks = HERE / "notebooks"
    notebooks.mkdir(exist_ok=True)
    for notebook in sorted((HERE.parent / "notebooks").glob("*.ipynb")):
        shutil.copyfile(notebook, notebooks / notebook.name)


def setup(app):
    app.connect("builder-inited", _generate)
