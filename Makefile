# Two commands on a fresh machine: `make demo` and `make test`. Both bootstrap .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo_out
PYTEST_WORKERS ?= 2

.PHONY: venv demo lint test test-fast clean

venv: $(STAMP)

# Reinstall when the package metadata changes. torch (CPU, a test-only dependency) is pinned
# to the build this machine ships so pip never pulls a multi-GB CUDA wheel. The `tpu` extra
# brings libtpu, which lets this CPU compile sharded steps for TPU pod topologies (tests, AOT);
# JAX_PLATFORMS=cpu keeps every run here on the CPU. `seqio` brings seqio and TensorFlow (data).
$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[seqio,test,tpu]'
	touch $(STAMP)

demo: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(VENV)/bin/jaxmoral demo --workdir=$(DEMO_DIR)

# Style (ruff) and types (mypy) of the package; settings in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check jaxmoral
	$(VENV)/bin/mypy jaxmoral

# --dist loadscope: a module's tests share one worker, so its module-scoped fixtures (trained
# runs, saved models) are built once, not once per worker. --no-loadscope-reorder: files go out
# in the order conftest.py sorts them (slowest first).
test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope \
	  --no-loadscope-reorder --durations=15 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -x -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder \
	  -m "not slow" tests

clean:
	rm -rf $(VENV) $(DEMO_DIR) build *.egg-info .pytest_cache
