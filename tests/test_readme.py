"""The README is the front page: short, with a runnable example, the set-up commands, real names and live links.

Its ```python blocks are executed by tests/test_docs_site.py, with the docs pages' blocks.
"""
import inspect
import pathlib
import re

import mixedad

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text()


def test_readme_is_a_front_page():
    assert len(TEXT.splitlines()) <= 200, "the README is the front page; the rest goes to docs/"


def test_readme_has_a_python_example():
    assert re.search(r"^```python\n.*?^```", TEXT, flags=re.M | re.S), "README has no python example"


def test_readme_gives_the_set_up_commands():
    for command in ("make demo", "make test", "make docs"):
        assert re.search(rf"^    {command}\b", TEXT, flags=re.M), f"README lacks `{command}` in its set-up block"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_links_resolve():
    local = [target for target in LINK.findall(TEXT) if "://" not in target]
    assert local, "README links to no docs page"
    missing = [target for target in local if not (ROOT / target).exists()]
    assert not missing, missing


def test_readme_links_every_docs_page():
    linked = {(ROOT / target).resolve() for target in LINK.findall(TEXT) if "://" not in target}
    pages = {page.resolve() for page in (ROOT / "docs").glob("*.md") if page.name != "index.md"}
    assert not pages - linked, sorted(page.name for page in pages - linked)


CALL = re.compile(r"`((?:mixedad\.)?[A-Za-z_][\w.]*)\(([^`]*?)\)`")


def test_readme_calls_use_the_real_parameter_names():
    """`mixed_grad(f, G, z, y, v)` and `input_grad(..., chunk_size=...)` name parameters the code has."""
    checked = 0
    for name, arguments in CALL.findall(TEXT):
        parts = name.removeprefix("mixedad.").split(".")
        if parts[0] not in mixedad.__all__:
            continue  # torch's functions, Python's
        obj = mixedad
        for part in parts:
            obj = getattr(obj, part)
        parameters = inspect.signature(obj).parameters
        for argument in filter(None, (a.strip() for a in arguments.split(","))):
            parameter = argument.split("=")[0].strip()
            assert parameter in parameters, f"README: {name}({arguments}) but the code has {list(parameters)}"
        checked += 1
    assert checked >= 4, checked
