"""The documentation site's sources: clean text, real signatures, runnable examples, a generated path table."""
import ast
import importlib.util
import inspect
import pathlib
import re

import pytest

import mixedad

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
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


HEADING = re.compile(r"^#+ .*?`(mixedad(?:\.\w+)+)(\(.*?\))`", re.M)


def _headings():
    for page in PAGES:
        for match in HEADING.finditer(page.read_text()):
            yield page.name, match.group(1), match.group(2)


@pytest.mark.parametrize("page, name, shown", list(_headings()), ids=lambda x: str(x)[:60])
def test_call_headings_show_the_real_signature(page, name, shown):
    obj = mixedad
    for part in name.split(".")[1:]:
        obj = getattr(obj, part)
    sig = inspect.signature(obj)
    plain = sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                        return_annotation=sig.empty)  # names, kinds and defaults; types are the reference's
    assert shown == str(plain), f"{page}: {name}{shown} but the code says {plain}"


def test_the_heading_check_finds_the_apis_headings():
    names = {name for _, name, _ in _headings()}
    assert {"mixedad.mixed_grad", "mixedad.input_grad", "mixedad.mixed_jacobian", "mixedad.tangent_report"} <= names


def _python_blocks():
    for page in PAGES:
        for k, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)):
            yield pytest.param(page, block, id=f"{page.name}-{k}")


@pytest.mark.parametrize("page, block", list(_python_blocks()))
def test_python_blocks_run(page, block):
    exec(compile(block, str(page), "exec"), {"__name__": f"docs_{page.stem}"})


def test_the_op_paths_page_shows_the_generated_table_of_exactly_the_tables_paths():
    spec = importlib.util.spec_from_file_location("docs_conf", ROOT / "docs" / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    table = conf._op_paths_table()
    shown = re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)
    assert shown == [p.value for p in mixedad.op_rules.PATHS]
    assert "_generated/op_paths_table.md" in (ROOT / "docs" / "op_paths.md").read_text()
    for func, rule in mixedad.op_rules.TABLE.items():
        assert mixedad.op_rules.op_name(func) in table
