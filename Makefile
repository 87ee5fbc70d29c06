# make train: install into .venv and train the demo on 8 fake CPU devices.
# make test: install the test, parity and tpu extras (libtpu lets tests compile for TPU topologies here) and run every
# test, then the fast tests of LOWER_TESTS again on the oldest releases pyproject.toml admits (constraints/lower.txt,
# in .venv-lower, without the parity extra: none of those tests compares against torch).
# Installs take the releases CI tested (constraints/current.txt); pyproject.toml itself states ranges.
#
# jax >= 0.11 needs Python >= 3.12: PYTHON is the first interpreter new enough (pyenv's too, where `python3` is older).
PYTHON ?= $(shell for p in python3 python3.13 python3.12 $$HOME/.pyenv/versions/3.1[2-9]*/bin/python3; do \
  $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { command -v $$p; exit; }; done)
VENV := .venv
PY := $(VENV)/bin/python
LOWER := .venv-lower
CPU8 := XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu
NEW_ENOUGH := -c 'import sys; sys.exit(sys.version_info < (3, 12))'

.PHONY: train test test-fast test-lower install install-test clean python

python:
	@test -n "$(PYTHON)" || { echo "error: maxctx needs Python >= 3.12 (jax >= 0.11 does) and none was found;" \
	  "install one or pass PYTHON=/path/to/python3.12" >&2; exit 2; }

# A venv from an older Python (or none) is made anew; an existing one of the right Python is updated in place.
$(VENV)/.base: pyproject.toml constraints/current.txt | python
	$(PY) $(NEW_ENOUGH) 2>/dev/null || $(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints/current.txt -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install --quiet -c constraints/current.txt -e '.[test,parity,tpu]'
	touch $@

$(LOWER)/.test: pyproject.toml constraints/lower.txt | python
	$(LOWER)/bin/python $(NEW_ENOUGH) 2>/dev/null || $(PYTHON) -m venv --clear $(LOWER)
	$(LOWER)/bin/python -m pip install --quiet --upgrade pip
	$(LOWER)/bin/python -m pip install --quiet -c constraints/lower.txt -e '.[test]'
	touch $@

install: $(VENV)/.base
install-test: $(VENV)/.test

train: $(VENV)/.base
	$(CPU8) $(PY) -m maxctx.train configs/demo.yml $(ARGS)

test: $(VENV)/.test $(LOWER)/.test
	$(CPU8) $(PY) -m pytest -q -n 2 tests $(ARGS)
	$(MAKE) --no-print-directory test-lower

test-fast: $(VENV)/.test
	$(CPU8) $(PY) -m pytest -q -m "not slow" tests $(ARGS)

# The oldest supported releases (the GPU images that ship jax 0.11 run maxctx unchanged): the fast tests of the files
# that touch each library's API -- jax's sharding, shard_map and Pallas (Triton lowering included), flax and optax in
# training, orbax checkpoints, grain pipelines, sentencepiece. The rest repeat those calls through other paths and
# run on current releases above (all of the fast subset on the lower releases took 27 minutes of 2 AMD EPYC cores).
LOWER_TESTS := tests/test_imports.py tests/test_config.py tests/test_mesh.py tests/test_attention.py \
  tests/test_flash_gpu.py tests/test_train.py tests/test_checkpoint.py tests/test_data_pipeline.py \
  tests/test_data_tokenizers.py tests/test_loss.py tests/test_rope.py
test-lower: $(LOWER)/.test
	$(CPU8) $(LOWER)/bin/python -m pytest -q -n 2 -m "not slow" $(LOWER_TESTS) $(ARGS)

clean:
	rm -rf $(VENV) $(LOWER) runs
