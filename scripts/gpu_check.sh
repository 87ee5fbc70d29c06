#!/usr/bin/env bash
# The NVIDIA GPU check of the flash kernel, one command on a GPU machine (no network needed), in under 8 minutes:
#   bash scripts/gpu_check.sh [OUT_DIR]          # from the repository root of a clean checkout; default runs/gpu_check
# It prints one table:
#   1. scripts/bench_attention.py --kernel flash --baseline cudnn: causal bfloat16 forward+backward at B=1, N=32, K=8,
#      H=128 and T = 32,768 and 131,072: TFLOP/s and tokens/s of flash without and with 16 packed documents, next to
#      cuDNN's fused attention (jax.nn.dot_product_attention, implementation="cudnn", is_causal=True, no documents).
#      Targets: flash ≥ 0.7 × cuDNN's TFLOP/s without documents; with documents, at least the tokens/s without.
#   2. python -m maxctx.train configs/recipes/gpu/llama3.1-8b-20l-128k-h200.yml attention.kernel=flash (the recipe's
#      default is blockwise) for 5 steps: step time, MFU (peak from maxctx/chips.py) and peak device memory of the
#      last step. Target: MFU ≥ 40%.
# The machine's Python must hold JAX with CUDA (>= 0.11), flax, optax and orbax; the rest of maxctx's needs travel as
# wheels in .whl/ (bash scripts/gpu_wheels.sh, where pip reaches PyPI), installed here into a scratch folder.
# Each stage has a time limit, so the script ends in time whatever a stage does; a stage that fails is a row saying so.
# For a rehearsal off the GPU (tests/test_flash_gpu.py runs one on the CPU, flash in the Pallas interpreter):
# GPU_CHECK_CPU=1 SEQ_LENS="256" TRAIN_ARGS="model.preset=tiny ..." bash scripts/gpu_check.sh OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_check}
SEQ_LENS=${SEQ_LENS:-32768 131072}
read -r -a TRAIN_EXTRA <<< "${TRAIN_ARGS:-}"
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/maxctx-site \
    .whl/*.whl || exit 2
  export PYTHONPATH="/tmp/maxctx-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95   # JAX's default 0.75 would leave a quarter of the GPU unused
[ -n "${GPU_CHECK_CPU:-}" ] || unset JAX_PLATFORMS XLA_FLAGS

"$PY" scripts/device_preflight.py gpu "run bash scripts/gpu_wheels.sh where pip reaches PyPI and bring .whl/ with the checkout" || exit 2

SHAPE=(--kernels flash --baseline cudnn --context 1 --strategies all_gather --batch 1 --heads 32 --kv-heads 8
       --head-dim 128 --dtype bfloat16 --documents 16 --iters 5)
for T in $SEQ_LENS; do
  timeout 150 "$PY" scripts/bench_attention.py "${SHAPE[@]}" --seq-len "$T" --json "$OUT/attention_$T.json" \
    > "$OUT/attention_$T.log" 2>&1
  echo "attention T=$T: exit $? (log: $OUT/attention_$T.log)"
done
rm -rf "$OUT/train"
timeout 240 "$PY" -m maxctx.train configs/recipes/gpu/llama3.1-8b-20l-128k-h200.yml run.steps=5 \
  attention.kernel=flash run.output_dir="$OUT/train" "${TRAIN_EXTRA[@]}" > "$OUT/train.log" 2>&1
echo "train: exit $? (log: $OUT/train.log)"

"$PY" - "$OUT" $SEQ_LENS <<'PYEOF'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
print("\n| check | T | row | fwd+bwd ms | TFLOP/s | tokens/s | ÷ cuDNN TFLOP/s | target |")
print("|---|---|---|---|---|---|---|---|")
for t in map(int, sys.argv[2:]):
  path = out / f"attention_{t}.json"
  if not path.exists():
    print(f"| attention | {t:,} | failed: see {out}/attention_{t}.log | | | | | |")
    continue
  rows = json.loads(path.read_text())["rows"]
  base = next((r for r in rows if r["kernel"] == "jax"), None)
  plain = next((r for r in rows if r["kernel"] == "flash" and "docs" not in r["strategy"]), None)
  for r in rows:
    docs = "docs" in r["strategy"]
    vs = r["fwd_bwd_tflops"] / base["fwd_bwd_tflops"] if base and r["kernel"] == "flash" and not docs else None
    if r["kernel"] != "flash":
      target = ""
    elif docs:
      met = plain is not None and r["fwd_bwd_tokens_per_s"] >= plain["fwd_bwd_tokens_per_s"]
      target = "tokens/s ≥ without documents: " + ("met" if met else "not met")
    else:
      target = "≥ 0.7 × cuDNN: " + ("met" if vs is not None and vs >= 0.7 else "not met")
    label = f"{r['strategy']} {r['kernel']}" + (" (interpreted: not a speed)" if r.get("interpreted") else "")
    print(f"| attention | {t:,} | {label} | {r['fwd_bwd_ms']:.1f} | {r['fwd_bwd_tflops']:.1f} | "
          f"{r['fwd_bwd_tokens_per_s']:,.0f} | {'' if vs is None else f'{vs:.2f}'} | {target} |")
log = (out / "train.log").read_text(errors="replace") if (out / "train.log").exists() else ""
steps = re.findall(r"step (\d+)/(\d+) \| loss ([\d.naninf]+) \| ([\d,]+) tok/s \| MFU ([\d.]+)% \| step ([\d.]+)s(.*)$",
                   log, re.M)
if steps:
  n, total, loss, tok, mfu, sec, rest = steps[-1]
  peak = (re.search(r"peak ([\d.]+) GiB", rest) or [None, None])[1]
  print(f"| train | recipe's | step {n}/{total}, loss {loss} | {1e3 * float(sec):.0f} | | {tok} | | "
        f"MFU {mfu}% (target ≥ 40%: {'met' if float(mfu) >= 40 else 'not met'}); peak {peak or '?'} GiB |")
else:
  print(f"| train | recipe's | failed or no step logged: see {out}/train.log | | | | | |")
PYEOF
