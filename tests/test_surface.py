"""The public surface: what ``import mixedad`` needs and exposes, and the names that moved."""
import subprocess
import sys
import warnings

import pytest

import mixedad


def _run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_import_mixedad_needs_only_torch_and_numpy():
    """With tqdm and matplotlib unimportable, mixedad imports, and neither is loaded by the import."""
    blocked = _run(
        "import sys\n"
        "for name in ('tqdm', 'matplotlib'):\n"
        "    sys.modules[name] = None  # import raises ImportError\n"
        "import mixedad, mixedad.benchmark, mixedad.programs\n"
        "print('ok')\n")
    assert blocked.returncode == 0, blocked.stderr
    # torch may load tqdm itself where it is installed: what mixedad's import adds is checked
    loaded = _run("import sys, torch\nbefore = set(sys.modules)\nimport mixedad\n"
                  "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} & {'tqdm', 'matplotlib'}))")
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"


def test_profile_without_tqdm_reports_a_line_per_run():
    """benchmark.profile's progress without tqdm: one line per run on the stream, the rows as with it."""
    result = _run(
        "import io, sys\n"
        "sys.modules['tqdm'] = None\n"
        "from mixedad import benchmark\n"
        "stream = io.StringIO()\n"
        "rows = benchmark.profile('mlp', [1], width=4, batch=2, repeats=1, stream=stream,\n"
        "                         strategies=['plain_forward', 'mixed_grad'])\n"
        "print(len(rows)); print(stream.getvalue())\n")
    assert result.returncode == 0, result.stderr
    count, *lines = result.stdout.strip().splitlines()
    assert count == "2"
    assert [line.split(" ")[:3] for line in lines] == [["profile", "mlp:", "1/2"], ["profile", "mlp:", "2/2"]]
    assert "mixed_grad" in lines[1]


def test_every_public_name_exists_and_program_internals_are_not_at_the_top():
    for name in mixedad.__all__:
        assert hasattr(mixedad, name), name
    assert not {"CompiledTangent", "compiled_tangents", "per_op_pass"} & set(mixedad.__all__)
    assert set(mixedad.programs.__all__) == {"CompiledTangent", "compiled_tangents", "per_op_pass"}


@pytest.mark.parametrize("name", ["CompiledTangent", "compiled_tangents", "per_op_pass"])
def test_a_moved_name_still_works_with_a_deprecation_warning(name):
    with pytest.warns(DeprecationWarning, match=rf"mixedad\.{name} is now mixedad\.programs\.{name}"):
        moved = getattr(mixedad, name)
    assert moved is getattr(mixedad.programs, name)


def test_an_unknown_name_raises_attribute_error_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
            mixedad.not_a_name  # noqa: B018
        assert not hasattr(mixedad, "also_not_a_name")
