#!/usr/bin/env bash
# Wheels for scripts/gpu_check.sh: what maxctx needs beyond a CUDA machine's own JAX, flax, optax, orbax, numpy,
# pyyaml, sentencepiece, tiktoken, absl-py, etils and matplotlib, for a GPU machine with no network. Run it where pip
# reaches PyPI, from the repository root; it fills .whl/ (git ignores it), which travels with the checkout:
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION]      # default 3.12, the GPU image's Python
# Versions are the ones CI tests (constraints/current.txt) where it pins them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
pin() {   # NAME -> NAME==VERSION from constraints/current.txt, else NAME
  local v
  v=$(grep -i "^$1==" constraints/current.txt | head -1 || true)
  echo "${v:-$1}"
}
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
mkdir -p .whl
for pkg in "$(pin grain)" "$(pin array-record)" "$(pin tensorboardX)" "$(pin portpicker)"; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$pkg"
done
ls -l .whl
