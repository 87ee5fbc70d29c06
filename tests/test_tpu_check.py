"""scripts/tpu_check.sh, the one command a TPU VM session runs to learn whether `flash` is exact and faster there,
rehearsed end to end on this CPU host (flash and splash in the Pallas interpreter, tiny shapes)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_tpu_check_script_rehearses_on_the_cpu(tmp_path):
  """Every stage runs and lands in the one table: flash's errors against `reference` under each strategy and layout,
  flash, blockwise and splash timed with and without documents (and splash's n/a where its mask cannot follow), a
  training run per kernel (flash refused off a TPU, in one sentence). Guards the script against drifting from the
  flags, JSON fields and log lines it reads."""
  env = dict(os.environ, TPU_CHECK_CPU="1", PYTHON=sys.executable, TIME_LIMIT_SCALE="5", SEQ_LENS="256",
             TRAIN_TOKENS="256", XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
             EXACT_ARGS="--kernels flash --seq-len 256 --heads 4 --kv-heads 2 --documents 3 --block 128",
             BENCH_ARGS="--heads 4 --kv-heads 2 --documents 3 --iters 1",
             TRAIN_ARGS="model.preset=tiny model.n_layers=2 model.loss_chunk=256 model.mlp_chunk=0 "
                        "attention.block_q=null attention.block_kv=null")
  result = subprocess.run(["bash", str(ROOT / "scripts" / "tpu_check.sh"), str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-2000:]
  table = [line for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
  exact = [line for line in table if line.startswith("| exact")]
  cases = {(line.split(" | ")[1], line.split(" | ")[2]) for line in exact}
  for strategy in ("all_gather", "ulysses", "ring", "usp 2x1"):
    for order in ("natural", "zigzag"):
      assert (f"{strategy}, {order}, packed documents", "flash (interpreted)") in cases, exact
  assert all("max error out" in line and "dv" in line and ": met |" in line for line in exact), exact

  timed = [line for line in table if line.startswith("| attention")]
  kernels = [line.split(" | ")[2].split(" (")[0] for line in timed]
  assert sorted(kernels) == ["blockwise", "blockwise", "flash", "flash", "splash", "splash", "splash"], timed
  assert any("T=256, causal | flash" in line and "≥ 0.7 × splash's TFLOP/s" in line for line in timed), timed
  assert any("T=256, 3 docs | flash" in line and "tokens/s ≥ without documents" in line for line in timed), timed
  assert any("T=256, 3 docs | splash" in line and "tokens/s" in line for line in timed), timed
  assert any("zigzag or ring chunks | splash | n/a" in line for line in timed), timed

  train = [line for line in table if line.startswith("| train")]
  assert len(train) == 2, table
  assert "| blockwise | step 3/3" in train[0] and "MFU" in train[0], train
  assert "| flash | refused: attention.kernel 'flash' runs only on tpu or gpu" in train[1], train
