# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create (or reuse) .venv and install the project from this repository's own files.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch; on machines with a local wheel cache this installs without a download.
TORCH  ?= torch==2.13.0

.PHONY: demo test lint local clean

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11 or newer is needed"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/atelier demo

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/cfn-lint template.yaml

local: $(STAMP)
	$(VENV)/bin/atelier local up

clean:
	rm -rf $(VENV) .atelier demo-output .pytest_cache
