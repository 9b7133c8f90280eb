"""Every public function documents its math and carries an example (run as a doctest)."""
import inspect

import pytest

import mixedad

MODULES = [mixedad, mixedad.reference, mixedad.profiling, mixedad.testing, mixedad.zoo, mixedad.distributed,
           mixedad.benchmark]
PUBLIC = [(m.__name__, name, getattr(m, name)) for m in MODULES for name in m.__all__
          if callable(getattr(m, name)) and not inspect.ismodule(getattr(m, name))]


@pytest.mark.parametrize("module, name, obj", PUBLIC, ids=[f"{m}.{n}" for m, n, _ in PUBLIC])
def test_public_function_documents_math_and_example(module, name, obj):
    doc = inspect.getdoc(obj) or ""
    assert ".. math::" in doc, f"{module}.{name}: no math block"
    assert ">>>" in doc, f"{module}.{name}: no example"


def test_every_public_name_is_exported_once():
    assert len(mixedad.__all__) == len(set(mixedad.__all__))
    for name in mixedad.__all__:
        assert hasattr(mixedad, name)
