#!/usr/bin/env bash
# The TPU check of the flash kernel, one command on a single-host TPU VM (v5p-8, v6e-8 or tpu7x-8; no network needed),
# in under 10 minutes:
#   bash scripts/tpu_check.sh [OUT_DIR]          # from the repository root of a clean checkout; default runs/tpu_check
# It prints one table:
#   1. scripts/check_kernel.py: flash and blockwise against `reference` with every device of the host on the context
#      axis, under all_gather, ulysses, ring and usp (all-to-all in pairs), in the natural and the zigzag layout, with
#      packed documents, a padding tail and GQA (B=2, T=4,096, N=16, K=4, H=128, bfloat16): the largest error of the
#      output and of dq, dk, dv. Target: within the CPU suite's bfloat16 tolerance (2e-2 of the largest value).
#   2. scripts/bench_attention.py --kernels flash blockwise --baseline splash on one device (the kernel alone): causal
#      bfloat16 forward+backward at B=1, N=32, K=8, H=128 and T = 32,768 and 131,072, without and with 16 packed
#      documents, next to JAX's splash attention (causal over token indices with segment ids: our mask in the natural
#      layout with contiguous documents; it cannot express it under zigzag or as the ring's chunk pieces: n/a there).
#      Targets: flash faster than blockwise and ≥ 0.7 × splash's TFLOP/s; with documents, at least the tokens/s without.
#   3. python -m maxctx.train on the 8B recipe configs/recipes/llama3.1-8b-1m-ring-v5p-128.yml (Llama 3.1 8B, ring,
#      zigzag, ZeRO-3 over the context axis) at 32,768 tokens over every device of the host, 3 steps with blockwise and
#      3 with flash: step time, MFU (peak from maxctx/chips.py) and peak device memory of the last step.
# The VM's Python must hold maxctx's dependencies with jax[tpu] (`pip install -e '.[tpu]'` where pip reaches PyPI, or the
# image docker/Dockerfile builds); wheels in .whl/ (bash scripts/gpu_wheels.sh) are installed into a scratch folder.
# Each stage has a time limit (100 + 80 + 180 + 2 × 100 s), so the script ends in time whatever a stage does; a stage
# that fails is a row saying so.
# For a rehearsal off the TPU (tests/test_tpu_check.py runs one on the CPU, flash and splash in the Pallas interpreter):
# TPU_CHECK_CPU=1 TIME_LIMIT_SCALE=5 SEQ_LENS="256" TRAIN_TOKENS=256 EXACT_ARGS="--seq-len 256 ..." BENCH_ARGS="..." TRAIN_ARGS="model.preset=tiny ..." \
#   bash scripts/tpu_check.sh OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/tpu_check}
SEQ_LENS=${SEQ_LENS:-32768 131072}
export TRAIN_TOKENS=${TRAIN_TOKENS:-32768}
SCALE=${TIME_LIMIT_SCALE:-1}   # the rehearsal on a shared CPU host stretches the limits
read -r -a EXACT_EXTRA <<< "${EXACT_ARGS:-}"
read -r -a BENCH_EXTRA <<< "${BENCH_ARGS:-}"
read -r -a TRAIN_EXTRA <<< "${TRAIN_ARGS:-}"
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/maxctx-site \
    .whl/*.whl || exit 2
  export PYTHONPATH="/tmp/maxctx-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
[ -n "${TPU_CHECK_CPU:-}" ] || unset JAX_PLATFORMS XLA_FLAGS

"$PY" scripts/device_preflight.py tpu "run pip install -e '.[tpu]' where pip reaches PyPI, or use the image docker/Dockerfile builds" || exit 2

timeout $(( 100 * SCALE )) "$PY" scripts/check_kernel.py --kernels flash blockwise "${EXACT_EXTRA[@]}" --json "$OUT/exact.json" \
  > "$OUT/exact.log" 2>&1
echo "exact: exit $? (log: $OUT/exact.log)"
SHAPE=(--kernels flash blockwise --baseline splash --context 1 --strategies all_gather --batch 1 --heads 32
       --kv-heads 8 --head-dim 128 --dtype bfloat16 --documents 16 --iters 3)
for T in $SEQ_LENS; do
  limit=$(( (T > 32768 ? 180 : 80) * SCALE ))
  timeout $limit "$PY" scripts/bench_attention.py "${SHAPE[@]}" "${BENCH_EXTRA[@]}" --seq-len "$T" \
    --json "$OUT/attention_$T.json" > "$OUT/attention_$T.log" 2>&1
  echo "attention T=$T: exit $? (log: $OUT/attention_$T.log)"
done
for K in blockwise flash; do
  rm -rf "$OUT/train_$K"
  timeout $(( 100 * SCALE )) "$PY" -m maxctx.train configs/recipes/llama3.1-8b-1m-ring-v5p-128.yml data.seq_len="$TRAIN_TOKENS" run.steps=3 \
    metrics.log_every=1 attention.kernel=$K run.output_dir="$OUT/train_$K" "${TRAIN_EXTRA[@]}" \
    > "$OUT/train_$K.log" 2>&1
  echo "train $K: exit $? (log: $OUT/train_$K.log)"
done

"$PY" - "$OUT" $SEQ_LENS <<'PYEOF'
import json, os, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
met = lambda ok: "met" if ok else "not met"  # noqa: E731
print("\n| check | case | kernel | result | target |")
print("|---|---|---|---|---|")
exact = out / "exact.json"
for r in json.loads(exact.read_text())["rows"] if exact.exists() else []:
  case = f"{r['strategy']}, {'zigzag' if r.get('zigzag') else 'natural'}, packed documents"
  if "errors" in r:
    errs = ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items())
    note = " (interpreted)" if r["interpreted"] else ""
    print(f"| exact | {case} | {r['kernel']}{note} | max error {errs} | ≤ {r['tolerance']:g}: {met(r['ok'])} |")
  else:
    print(f"| exact | {r['strategy']} | {r['kernel']} | {r.get('refused') or 'failed: ' + r['failed']} | |")
if not exact.exists():
  print(f"| exact | every strategy | flash | failed: see {out}/exact.log | |")
for t in map(int, sys.argv[2:]):
  path = out / f"attention_{t}.json"
  if not path.exists():
    print(f"| attention | T={t:,} | flash | failed: see {out}/attention_{t}.log | |")
    continue
  rows = json.loads(path.read_text())["rows"]
  def find(kernel, docs):
    return next((r for r in rows if r["kernel"] == kernel and ("docs" in r["strategy"]) == docs), None)
  for r in rows:
    docs = "docs" in r["strategy"]
    kernel = "splash" if r["kernel"] == "jax" else r["kernel"]
    target = ""
    if kernel == "flash" and docs:
      plain = find("flash", False)
      target = "tokens/s ≥ without documents: " + met(plain and r["fwd_bwd_tokens_per_s"] >= plain["fwd_bwd_tokens_per_s"])
    elif kernel == "flash":
      blockwise, splash = find("blockwise", False), find("jax", False)
      vs = r["fwd_bwd_tflops"] / splash["fwd_bwd_tflops"] if splash else None
      target = (f"faster than blockwise: {met(blockwise and r['fwd_bwd_ms'] < blockwise['fwd_bwd_ms'])}; "
                f"≥ 0.7 × splash's TFLOP/s: {met(vs is not None and vs >= 0.7)}" + (f" ({vs:.2f})" if vs else ""))
    case = f"T={t:,}" + (f", {r['strategy'].split(' ', 1)[1]}" if docs else ", causal")
    note = " (interpreted: not a speed)" if r.get("interpreted") else ""
    print(f"| attention fwd+bwd | {case} | {kernel}{note} | {r['fwd_bwd_ms']:.1f} ms, {r['fwd_bwd_tflops']:.1f} TFLOP/s, "
          f"{r['fwd_bwd_tokens_per_s']:,.0f} tokens/s | {target} |")
  print(f"| attention fwd+bwd | T={t:,}, zigzag or ring chunks | splash | n/a: its mask is static over token indices | |")
case = f"8B recipe, {int(os.environ['TRAIN_TOKENS']):,} tokens"
for kernel in ("blockwise", "flash"):
  log = out / f"train_{kernel}.log"
  text = log.read_text(errors="replace") if log.exists() else ""
  steps = re.findall(r"step (\d+)/(\d+) \| loss ([\d.naninf]+) \| ([\d,]+) tok/s \| MFU ([\d.]+)% \| step ([\d.]+)s(.*)$",
                     text, re.M)
  target = "MFU ≥ 40%: " if kernel == "flash" else ""
  if steps:
    n, total, loss, tok, mfu, sec, rest = steps[-1]
    peak = (re.search(r"peak ([\d.]+) GiB", rest) or [None, None])[1]
    print(f"| train | {case} | {kernel} | step {n}/{total}, loss {loss}, {sec} s, {tok} tokens/s, "
          f"MFU {mfu}%, peak {peak or '?'} GiB | {target + met(float(mfu) >= 40) if target else ''} |")
  else:
    error = re.search(r"^error: (.*)$", text, re.M)
    print(f"| train | {case} | {kernel} | "
          f"{'refused: ' + error[1] if error else 'failed or no step logged: see ' + str(log)} | |")
PYEOF
