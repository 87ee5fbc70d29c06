# make train: install into .venv and train the demo on 8 fake CPU devices.   make test: install and run every test.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test test-fast install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu $(PY) -m maxctx.train configs/demo.yml $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup tests $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests $(ARGS)

clean:
	rm -rf $(VENV) runs
