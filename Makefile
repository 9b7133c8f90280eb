# Two commands do all the set-up on a fresh machine with python3 and make:
#   make demo   create .venv if missing, install mixedad, run the demo
#   make test   the same with the test extras, then run the whole suite, notebooks included
#   make test-quick   the suite without the slow OpInfo sweep and the notebooks
#   make docs   the documentation site (Sphinx) into docs/_build/html
#   make typecheck   mypy on the public modules
#   make unused   the unused-code check (vulture) on the package
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --constraint constraints.txt

.PHONY: demo test test-quick typecheck unused docs notebooks install install-test install-docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(PY) setup.cfg setup.py constraints.txt
	$(PIP) --editable .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) --editable '.[test]'
	touch $@

$(VENV)/.installed-docs: $(VENV)/.installed
	$(PIP) --editable '.[docs]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test
install-docs: $(VENV)/.installed-docs

demo: install
	$(PY) -m mixedad demo

test: install-test
	$(PY) -m pytest -q --nbmake tests mixedad notebooks

# Everything but the slow sweeps (one OpInfo test per op) and the notebooks: for development.
test-quick: install-test
	$(PY) -m pytest -q -m "not slow" tests mixedad

# mypy on the public modules (mypy.ini).
typecheck: install-test
	$(PY) -m mypy

# Unused code in the package (vulture; what it cannot see is listed in the script).
unused: install-test
	$(PY) scripts/unused_code.py

# The documentation site, warnings as errors, into docs/_build/html.
docs: install-docs
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

notebooks: install-test
	$(PY) scripts/build_notebooks.py --execute

clean:
	rm -rf $(VENV) *.egg-info build dist docs/_build docs/_generated docs/notebooks
