"""The documentation site's sources: clean text, real signatures, runnable examples, a generated path table."""
import ast
import importlib
import importlib.util
import inspect
import pathlib
import re

import pytest

import mixedad

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs").glob("*.rst"))]
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_control_characters_in_pages(page):
    found = CONTROL.search(page.read_text())
    assert found is None, f"{page.name}: control character {found.group()!r}"


def _public_docstrings():
    for module_path in sorted((ROOT / "mixedad").rglob("*.py")):
        tree = ast.parse(module_path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    yield module_path.relative_to(ROOT).as_posix(), getattr(node, "name", "<module>"), doc


def test_no_control_characters_in_docstrings():
    """A backspace hides in a non-raw docstring's \\b (\\big, \\bar); the docs would show it."""
    bad = [(path, name) for path, name, doc in _public_docstrings() if CONTROL.search(doc)]
    assert not bad, bad


PUBLIC_MODULES = ["mixedad", "mixedad.reference", "mixedad.testing", "mixedad.profiling", "mixedad.benchmark",
                  "mixedad.distributed", "mixedad.zoo", "mixedad.op_rules"]


def test_no_control_characters_in_public_docstrings_as_imported():
    """The docstrings autodoc shows, read from the objects (a docstring may be built at import)."""
    bad = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        objects = [(module_name, module)] + [(f"{module_name}.{n}", getattr(module, n)) for n in module.__all__]
        for qualname, obj in objects:
            members = [(qualname, obj)]
            if inspect.isclass(obj):
                members += [(f"{qualname}.{n}", m) for n, m in vars(obj).items() if not n.startswith("_")]
            for where, member in members:
                doc = getattr(member, "__doc__", None)
                if isinstance(doc, str) and CONTROL.search(doc):
                    bad.append(where)
    assert not bad, bad


HEADING = re.compile(r"^#+ .*?`((?:mixedad\.)?[A-Za-z_][\w.]*)(\(.*?\))`", re.M)


def _headings():
    for page in PAGES:
        for match in HEADING.finditer(page.read_text()):
            name = match.group(1)
            if name.startswith("mixedad.") or name.split(".")[0] in mixedad.__all__:
                yield page.name, name, match.group(2)


@pytest.mark.parametrize("page, name, shown", list(_headings()), ids=lambda x: str(x)[:60])
def test_call_headings_show_the_real_signature(page, name, shown):
    """A heading that shows a call (`mixedad.x(...)`, or a public name bare) shows mixedad's real signature."""
    obj = mixedad
    for part in name.removeprefix("mixedad.").split("."):
        assert hasattr(obj, part), f"{page}: heading shows {name}{shown}, which is not in mixedad"
        obj = getattr(obj, part)
    sig = inspect.signature(obj)
    plain = sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                        return_annotation=sig.empty)  # names, kinds and defaults; types are the reference's
    assert shown == str(plain), f"{page}: {name}{shown} but the code says {plain}"


def test_the_heading_check_finds_the_apis_headings():
    names = {name for _, name, _ in _headings()}
    assert {"mixedad.mixed_grad", "mixedad.input_grad", "mixedad.mixed_jacobian", "mixedad.tangent_report"} <= names


# A ```python block runs unless the line before it is `<!-- skip: why -->`: sparingly, for snippets
# that need a GPU or several processes. Other Python fences (```py, ```python3) are not allowed.
FENCE = re.compile(r"(?:^<!-- skip: (?P<why>[^\n]*?) -->\n)?^```python\n(?P<code>.*?)^```", re.M | re.S)
MAX_SKIPPED = 2


def _blocks():
    for page in PAGES:
        for k, match in enumerate(FENCE.finditer(page.read_text())):
            yield page, k, match.group("code"), match.group("why")


def _python_blocks():
    for page, k, code, why in _blocks():
        marks = [pytest.mark.skip(reason=why)] if why is not None else []
        yield pytest.param(page, code, id=f"{page.name}-{k}", marks=marks)


@pytest.mark.parametrize("page, block", list(_python_blocks()))
def test_python_blocks_run(page, block):
    exec(compile(block, str(page), "exec"), {"__name__": f"docs_{page.stem}"})


def test_skipped_blocks_are_few_say_why_and_compile():
    skipped = [(page.name, k, code, why) for page, k, code, why in _blocks() if why is not None]
    assert len(skipped) <= MAX_SKIPPED, [(name, k) for name, k, _, _ in skipped]
    for name, k, code, why in skipped:
        assert why.strip(), f"{name} block {k}: the skip marker says no reason"
        compile(code, f"{name} block {k}", "exec")


def test_python_code_is_fenced_as_python():
    """```py and friends would be shown but never run; a skip marker must sit right above a ```python fence."""
    for page in PAGES:
        text = page.read_text()
        other = re.findall(r"^```(py|python3|ipython|pycon)\s*$", text, flags=re.M)
        assert not other, f"{page.name}: fence ```{other[0]}; use ```python (and <!-- skip: why --> if it cannot run)"
        for match in re.finditer(r"^<!-- skip:.*-->\n(.*)", text, flags=re.M):
            assert match.group(1) == "```python", f"{page.name}: a skip marker not right above a ```python fence"


def test_the_block_finder_finds_the_pages_examples():
    found = {(page.name, why is None) for page, _, _, why in _blocks()}
    assert {("README.md", True), ("quickstart.md", True), ("api.md", True), ("op_paths.md", True)} <= found


def _label(path):
    return str(path.value) if hasattr(path, "value") else str(path)


def test_the_op_paths_page_shows_the_generated_table_of_exactly_the_tables_paths():
    spec = importlib.util.spec_from_file_location("docs_conf", ROOT / "docs" / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    table = conf._op_paths_table()
    shown = re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)
    assert shown == [_label(p) for p in mixedad.op_rules.PATHS]
    assert "```{include} _generated/op_paths_table.md" in (ROOT / "docs" / "op_paths.md").read_text()
    rows = {row.split(" | ")[0].strip("| `"): row for row in table.splitlines()[2:]}
    for func, rule in mixedad.op_rules.TABLE.items():
        assert f"`{mixedad.op_rules.op_name(func)}`" in rows[_label(rule.path)], (func, rule.path)


def test_the_op_paths_page_lists_what_programs_cover_generated_from_their_tables():
    from mixedad._programs.rules import FUNCTIONS, METHODS, MODULES

    spec = importlib.util.spec_from_file_location("docs_conf", ROOT / "docs" / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    coverage = conf._program_coverage()
    assert all(f"`nn.{cls.__name__}`" in coverage for cls in MODULES)
    assert all(f"`Tensor.{name}`" in coverage for name in METHODS)
    assert f"**Functions** ({len(set(FUNCTIONS))})" in coverage
    assert "```{include} _generated/program_coverage.md" in (ROOT / "docs" / "op_paths.md").read_text()
