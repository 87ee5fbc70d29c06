# make train: install into .venv and train the demo on 8 fake CPU devices.
# make test: install the test and tpu extras (libtpu lets tests compile for TPU topologies here) and run every test.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CPU8 := XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu

.PHONY: train test test-fast install install-test clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install --quiet -e '.[test,tpu]'
	touch $@

install: $(VENV)/.base
install-test: $(VENV)/.test

train: $(VENV)/.base
	$(CPU8) $(PY) -m maxctx.train configs/demo.yml $(ARGS)

test: $(VENV)/.test
	$(CPU8) $(PY) -m pytest -q -n 2 tests $(ARGS)

test-fast: $(VENV)/.test
	$(CPU8) $(PY) -m pytest -q -m "not slow" tests $(ARGS)

clean:
	rm -rf $(VENV) runs
