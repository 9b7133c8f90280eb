"""The house: layers as folders, one test file per module, torch's internals reached only through _hooks, and
imports that run down the layers only, with no cycle.

Layers, bottom up (:data:`LAYERS`): ``mixedad/_hooks/`` (every reach into torch's private API), the ground floor
(``mixedad/_ground/``: grad mode, state and its replay, nesting, errors, the pass lock; with the checks of
arguments and the public calls' wrappers), ``mixedad/op_rules/`` (the rule table and one module per rule family),
``mixedad/_programs/`` (tangent programs), ``mixedad/_frontend/`` (the tangent pass), ``mixedad/_backend.py``
(reverse mode), the public calls, the planner, and the tools and the package's face.
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
    "mixedad/_version.py": "tests/test_surface.py",
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
    "mixedad/_ground/__init__.py": "tests/test_layout.py",
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


#: The layers, bottom up, by the first name under ``mixedad`` (a folder or a module). A module imports only from its
#: own layer and those below, and no two modules import each other, directly or round a cycle. Imports inside
#: functions count: they are imports all the same.
LAYERS = (
    ("_hooks",),
    ("_ground", "_entry", "_checks", "_version"),
    ("op_rules",),
    ("_programs",),
    ("_frontend",),
    ("_backend",),
    ("_curvature", "mixed", "input_grad", "reference", "curvature", "implicit", "cached", "graph", "penalties",
     "report", "distributed", "testing", "zoo", "programs"),
    ("_planner", "profiling"),
    ("benchmark", "demo", "cli", "__main__", "__init__"),
)


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _import_graph():
    """module -> {module it imports: line}, over every import in mixedad (top level and inside functions)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name):
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in modules else None

    graph = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                found = resolve(target) if target.startswith("mixedad") else None
                if found is not None and found != name:
                    edges.setdefault(found, node.lineno)
    return graph


def _layer_of(module):
    parts = module.split(".")
    first = parts[1] if len(parts) > 1 else "__init__"
    for rank, layer in enumerate(LAYERS):
        if first in layer:
            return rank
    raise AssertionError(f"{module}: not in any layer of LAYERS; add {first!r} where it belongs")


def _upward(graph):
    return [f"{a} (layer {_layer_of(a)}) imports {b} (layer {_layer_of(b)}), line {line}"
            for a, edges in sorted(graph.items()) for b, line in sorted(edges.items()) if _layer_of(b) > _layer_of(a)]


def _cycles(graph):
    """The import cycles of ``graph``: its strongly connected components of more than one module (Tarjan)."""
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_every_module_belongs_to_a_layer_and_imports_run_down_the_layers():
    upward = _upward(_import_graph())
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_no_import_cycles():
    assert not _cycles(_import_graph())


def test_the_layer_checks_find_an_upward_import_and_a_cycle():
    """The checks above can fail: a rule importing the pass goes up, and modules importing each other round a
    loop are a cycle (the one between the pass and the programs that the ground floor broke)."""
    assert _upward({"mixedad.op_rules._dispatch": {"mixedad._frontend.tangents": 7}}) == [
        "mixedad.op_rules._dispatch (layer 2) imports mixedad._frontend.tangents (layer 4), line 7"]
    assert not _upward({"mixedad._frontend.tangents": {"mixedad.op_rules._dispatch": 7}})
    loop = {"mixedad._frontend.tangents": {"mixedad._programs.cache": 1},
            "mixedad._programs.cache": {"mixedad._programs.trace": 1},
            "mixedad._programs.trace": {"mixedad._frontend.tangents": 1}, "mixedad._hooks.dispatch_modes": {}}
    assert _cycles(loop) == [["mixedad._frontend.tangents", "mixedad._programs.cache", "mixedad._programs.trace"]]
    graph = _import_graph()  # the real graph holds both ends of each layer
    assert "mixedad._hooks.dual_level" in graph["mixedad.op_rules._dispatch"]
    assert _layer_of("mixedad") == len(LAYERS) - 1 and _layer_of("mixedad._hooks.dispatch_modes") == 0


def test_no_two_modules_share_a_name():
    """Modules are named by what they hold: two files of one name (a leading underscore aside) in two folders
    would be two things called alike."""
    names = {}
    for module in _modules():
        name = module.rsplit("/", 1)[1].lstrip("_")
        if name != "init__.py":
            names.setdefault(name, []).append(module)
    assert not {n: ms for n, ms in names.items() if len(ms) > 1}


def test_the_package_shows_its_layers():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert {"_hooks", "_ground", "op_rules", "_frontend", "_curvature", "_programs", "_planner", "zoo"} <= folders
    assert (PACKAGE / "_backend.py").exists()
    private_top = sorted(p.name for p in PACKAGE.glob("_*.py") if not p.name.startswith("__"))
    assert private_top == ["_backend.py", "_checks.py", "_entry.py", "_version.py"], private_top


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
