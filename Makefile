# Two commands do all the set-up on a fresh machine with python3 and make:
#   make demo   create .venv if missing, install mixedad, run the demo
#   make test   the same with the test extras, then run the whole suite, notebooks included
#   make test-quick   the suite without the slow OpInfo sweep and the notebooks
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --constraint constraints.txt

.PHONY: demo test test-quick notebooks install install-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(PY) setup.cfg setup.py constraints.txt
	$(PIP) --editable .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) --editable '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(PY) -m mixedad demo

test: install-test
	$(PY) -m pytest -q --nbmake tests mixedad notebooks

# Everything but the slow sweeps (one OpInfo test per op) and the notebooks: for development.
test-quick: install-test
	$(PY) -m pytest -q -m "not slow" tests mixedad

notebooks: install-test
	$(PY) scripts/build_notebooks.py --execute

clean:
	rm -rf $(VENV) *.egg-info build dist
