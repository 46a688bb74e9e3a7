# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create (or reuse) .venv and install the project from this repository's own files.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The ML stack's versions come from constraints.txt, the pin list trainer/Dockerfile installs too.
# torch: on machines with a local wheel cache this is the CPU build, installed without a download.
TORCH  ?= $(shell grep -m1 '^torch==' constraints.txt)
# uv installs what pip would, from the sources pip is configured with (tools/pip_sources.py): the three
# environments took 93 s with pip on the 2-core machine, 57 s with uv. Like pip it compiles the bytecode
# (40 s of the 57): where PYTHONDONTWRITEBYTECODE is set nothing else would, and every process that
# imports torch, diffusers and moto would compile them again (7.6 s against 3.0 s).
UV      := $(VENV)/bin/uv
UV_PIN  := uv==0.13.8
INSTALL  = $(UV) pip install --quiet --compile-bytecode $(shell $(PY) tools/pip_sources.py)

.PHONY: demo test lint local clean checkov-env browser gpu-test gpu-test-wheels

$(UV):
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11 or newer is needed"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(UV_PIN)"

$(STAMP): pyproject.toml constraints.txt $(UV)
	$(INSTALL) --python $(PY) -c constraints.txt "$(TORCH)"
	$(INSTALL) --python $(PY) -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/atelier demo

# img2dataset (for the import tests) in a virtual environment of its own: see pyproject.toml.
I2D       := .venv-img2dataset
I2D_STAMP := $(I2D)/.installed

$(I2D_STAMP): pyproject.toml $(UV)
	$(UV) venv --quiet --allow-existing --python $(PYTHON) $(I2D)
	$(INSTALL) --python $(I2D)/bin/python $$($(PY) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["img2dataset"])')
	touch $(I2D_STAMP)

# checkov pins an old boto3, so it gets its own environment; tests/unit/test_checkov.py runs it.
CHECKOV       := .venv-checkov
CHECKOV_STAMP := $(CHECKOV)/.installed

$(CHECKOV_STAMP): $(UV)
	$(UV) venv --quiet --allow-existing --python $(PYTHON) $(CHECKOV)
	$(INSTALL) --python $(CHECKOV)/bin/python "checkov==3.3.30"
	touch $(CHECKOV_STAMP)

checkov-env: $(CHECKOV_STAMP)

# The headless browser tests/trainer/test_report_browser.py renders training reports in: Debian's
# chromium-headless-shell, installed when this runs as root with apt (as on CI); elsewhere
# `sudo make browser`. Without one that test skips, and fails under CI (.ci/run sets CI). The stamp
# is touched only once the browser is there, so a failed install is tried again on the next run.
BROWSER_STAMP := $(VENV)/.browser

$(BROWSER_STAMP): $(STAMP)
	@if command -v chromium-headless-shell >/dev/null 2>&1 || \
	    { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && apt-get update -qq && \
	      apt-get install -y -qq --no-install-recommends chromium-headless-shell >/dev/null; }; \
	then touch $@; \
	else echo "note: no chromium-headless-shell (sudo make browser): the report rendering test skips, and fails under CI"; fi

# Every test file, in parallel (pyproject.toml; docs/testing.md says why three processes on two cores).
test: $(STAMP) $(I2D_STAMP) $(CHECKOV_STAMP) $(BROWSER_STAMP)
	@$(PY) -m pytest

# The GPU tests (tests/gpu/, docs/testing.md "GPU tests"), run on the GPU machine with its own Python, never
# .venv's: torch, transformers and numpy are there, the wheels of gpu-test-wheels are carried (tests/gpu/README.md).
# --confcutdir leaves tests/conftest.py (boto3, moto) unloaded. The JUnit report, with each test's measured
# figures, goes to $(GPU_TEST_REPORT): $OUT/gpu-tests.xml where OUT is set (the device tool brings $OUT back).
GPU_PYTHON      ?= python3
GPU_TEST_REPORT ?= $(or $(OUT),.)/gpu-tests.xml
GPU_TEST_WHEELS := diffusers==0.42.1 importlib_metadata==8.7.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 \
                   pygments==2.21.0 packaging==26.4

gpu-test:
	$(GPU_PYTHON) -m pytest tests/gpu -m gpu -p no:xdist -p no:cacheprovider -o addopts="" --confcutdir tests/gpu \
		-ra -v --junitxml $(GPU_TEST_REPORT)

# Here: those wheels (pure Python) into .whl/ (ignored), to carry to the GPU machine.
gpu-test-wheels: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl $(GPU_TEST_WHEELS)

lint: $(STAMP)
	$(VENV)/bin/cfn-lint template.yaml

local: $(STAMP)
	$(VENV)/bin/atelier local up

browser:
	apt-get update -qq && apt-get install -y --no-install-recommends chromium-headless-shell

clean:
	rm -rf $(VENV) $(I2D) $(CHECKOV) .atelier demo-output .pytest_cache
