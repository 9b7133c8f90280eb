"""The house: layers as folders, one test file per module, torch's internals reached only through _hooks.

Layers, bottom up: ``mixedad/_hooks/`` (every reach into torch's private API), ``mixedad/op_rules/``
(the rule table and one module per rule family), ``mixedad/_frontend/`` (the tangent pass),
``mixedad/_backend.py`` (reverse mode), and the public modules.
"""
import ast
import io
import json
import pathlib
import re
import tokenize

import pytest

import mixedad

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mixedad"
#: Modules whose tests live in a file not named after them.
TESTED_IN = {
    "mixedad/__init__.py": "tests/test_surface.py",
    "mixedad/programs.py": "tests/test_surface.py",
    "mixedad/_planner/storage.py": "tests/test_profiling.py",
    "mixedad/__main__.py": "tests/test_cli.py",
    "mixedad/demo.py": "tests/test_cli.py",
    "mixedad/_entry.py": "tests/test_contexts.py",
    "mixedad/mixed.py": "tests/test_mixed.py",
    "mixedad/op_rules/__init__.py": "tests/test_layout.py",
    "mixedad/op_rules/_user.py": "tests/op_rules/test_register.py",
    "mixedad/benchmark.py": "tests/test_benchmarks.py",
    "mixedad/_hooks/__init__.py": "tests/test_layout.py",
    "mixedad/_frontend/__init__.py": "tests/test_layout.py",
    "mixedad/_curvature/__init__.py": "tests/test_layout.py",
    "mixedad/_planner/__init__.py": "tests/test_layout.py",
    "mixedad/_programs/__init__.py": "tests/test_layout.py",
}
ZOO_TESTS = "tests/test_zoo.py"


def _modules():
    return sorted(p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py"))


def _expected_test(module):
    if module in TESTED_IN:
        return TESTED_IN[module]
    if module.startswith("mixedad/zoo/"):
        return ZOO_TESTS
    folder, name = module.rsplit("/", 1)
    tests = "tests" + folder[len("mixedad"):]
    return f"{tests}/test_{name.lstrip('_')}"


@pytest.mark.parametrize("module", _modules())
def test_every_module_has_its_test_file(module):
    assert (ROOT / _expected_test(module)).exists(), f"{module}: expected its tests in {_expected_test(module)}"


def test_the_package_shows_its_layers():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert {"_hooks", "op_rules", "_frontend", "_curvature", "_programs", "zoo"} <= folders
    assert (PACKAGE / "_backend.py").exists()
    private_top = sorted(p.name for p in PACKAGE.glob("_*.py") if not p.name.startswith("__"))
    assert private_top == ["_backend.py", "_checks.py", "_entry.py"], private_top


@pytest.mark.parametrize("face", ["mixedad/op_rules/__init__.py", "mixedad/programs.py"])
def test_a_face_only_re_exports(face):
    """A package's face holds its docstring, imports and ``__all__``: the code lives in the modules it names."""
    tree = ast.parse((ROOT / face).read_text())
    body = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body
    for node in body:
        is_all = isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
        assert isinstance(node, (ast.Import, ast.ImportFrom)) or is_all, \
            f"{face}:{node.lineno}: {type(node).__name__} in a face that only re-exports"
    assert any(isinstance(node, ast.Assign) for node in body), f"{face}: no __all__"


def _code_only(path):
    """The module's source without comments and strings (docstrings and messages may name torch internals)."""
    out = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type not in (tokenize.COMMENT, tokenize.STRING):
            out.append(token.string)
    return " ".join(out)


PRIVATE_TORCH = re.compile(r"torch \. _(?!_)\w+|\b_C\b|_pytree|_python_dispatch|_SingleLevelFunction|_pop_mode_temporarily"
                           r"|_orig_mod|_torchdynamo|_current_level|_unpack_dual|_make_dual")


@pytest.mark.parametrize("module", [m for m in _modules() if not m.startswith("mixedad/_hooks/")])
def test_torch_internals_are_reached_only_through_hooks(module):
    code = _code_only(ROOT / module)
    found = sorted(set(PRIVATE_TORCH.findall(code)))
    assert not found, f"{module} reaches torch internals {found}; move that into mixedad/_hooks/ with a pin test"


@pytest.mark.parametrize("hook", sorted(p.name for p in (PACKAGE / "_hooks").glob("[a-z]*.py")))
def test_every_hook_states_what_it_relies_on_and_is_pinned(hook):
    doc = ast.get_docstring(ast.parse((PACKAGE / "_hooks" / hook).read_text())) or ""
    if hook not in ("refcount.py", "thread_local.py"):  # helpers of the hooks: no torch assumption
        assert "relies on" in doc, f"_hooks/{hook}: its docstring must say what torch behaviour it relies on"
    assert (ROOT / "tests" / "_hooks" / f"test_{hook}").exists()


def _imports_of_public_names_only(source):
    tree = ast.parse(source)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mixedad"):
            if any(part.startswith("_") for part in node.module.split(".")):
                bad.append(node.module)
            bad += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.startswith("mixedad") and "._" in a.name]
    return bad


@pytest.mark.parametrize("script", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks").glob("*.py")))
def test_benchmarks_import_only_public_names(script):
    assert not _imports_of_public_names_only((ROOT / script).read_text())


@pytest.mark.parametrize("notebook", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks").glob("*.ipynb")))
def test_notebooks_import_only_public_names(notebook):
    cells = json.loads((ROOT / notebook).read_text())["cells"]
    source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    source = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    assert not _imports_of_public_names_only(source)


def test_the_public_surface_is_all():
    assert mixedad.__all__ and all(hasattr(mixedad, name) for name in mixedad.__all__)
    assert all(not name.startswith("_") or name == "__version__" for name in mixedad.__all__)
    assert "register" in mixedad.op_rules.__all__ and all(hasattr(mixedad.op_rules, n) for n in mixedad.op_rules.__all__)


PUBLIC_MODULES = ["mixedad", "mixedad.mixed", "mixedad.input_grad", "mixedad.report", "mixedad.cached", "mixedad.graph",
                  "mixedad.penalties", "mixedad.reference", "mixedad.testing", "mixedad.profiling",
                  "mixedad.distributed", "mixedad.op_rules", "mixedad.benchmark", "mixedad.zoo", "mixedad.cli",
                  "mixedad.demo"]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_public_module_has_all(name):
    import importlib

    module = importlib.import_module(name)
    assert isinstance(getattr(module, "__all__", None), (list, tuple)), f"{name} has no __all__"
    assert all(hasattr(module, n) for n in module.__all__)


def _annotated_callables():
    import importlib
    import inspect

    typed = ["mixedad.mixed", "mixedad.input_grad", "mixedad.report", "mixedad.cached", "mixedad.graph",
             "mixedad.penalties", "mixedad.reference", "mixedad.testing", "mixedad.profiling", "mixedad.distributed",
             "mixedad.op_rules"]
    for name in typed:
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if inspect.isfunction(obj):
                yield f"{name}.{attr}", obj
            elif inspect.isclass(obj) and obj.__module__.startswith("mixedad"):
                for meth_name, meth in vars(obj).items():
                    if inspect.isfunction(meth) and (not meth_name.startswith("_") or meth_name == "__init__"):
                        yield f"{name}.{attr}.{meth_name}", meth


@pytest.mark.parametrize("name, func", list(_annotated_callables()), ids=lambda x: x if isinstance(x, str) else "")
def test_the_public_api_is_annotated(name, func):
    import inspect

    sig = inspect.signature(func)
    missing = [p.name for p in sig.parameters.values() if p.name not in ("self", "cls") and p.annotation is p.empty]
    assert not missing, f"{name}: parameters without a type: {missing}"
    assert sig.return_annotation is not sig.empty, f"{name}: no return type"
