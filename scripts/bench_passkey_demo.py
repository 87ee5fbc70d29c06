"""The passkey demo as a benchmark: docs/evaluation.md's command once per seed, with its accuracies, wall time and
the load.

  python scripts/bench_passkey_demo.py [--seeds 0,1,2] [--command eval|train] [--out DIR] [section.key=value ...]

`--command eval` (default) runs docs/evaluation.md's `python -m maxctx.eval configs/demo-passkey.yml --train --lengths
128,256,512 --depths 0,0.25,0.5,0.75,1 --samples 8`, `--command train` runs `python -m maxctx.train
configs/demo-passkey.yml`; each seed in its own process and output directory (8 fake CPU devices unless XLA_FLAGS
says otherwise). The table gives the in-training eval at 128 tokens at each eval.every_steps (from TensorBoard), the
final sweep's accuracy per length (eval only), the command's wall time and the 1-minute load average before and after
it: on a shared machine the wall time means little without the load. tests/test_eval_passkey_demo.py is the guard CI
runs; this is the measurement docs/results.md records.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = "configs/demo-passkey.yml"
SWEEP = ["--lengths", "128,256,512", "--depths", "0,0.25,0.5,0.75,1", "--samples", "8"]


def _scalars(logdir: pathlib.Path, tag: str) -> list[tuple[int, float]]:
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(str(logdir))
  acc.Reload()
  return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def sweep_accuracy(eval_dir: pathlib.Path) -> dict[int, float]:
  """Accuracy per length of the sweep written to eval_dir/eval.jsonl (scripts/bench_extend_demo.py uses it too)."""
  cells: dict[int, list[bool]] = {}
  for line in (eval_dir / "eval.jsonl").read_text().splitlines():
    r = json.loads(line)
    cells.setdefault(r["length"], []).append(r["correct"])
  return {n: sum(v) / len(v) for n, v in sorted(cells.items())}


def run_logged(args: list[str], seed: int, out: pathlib.Path) -> dict:
  """Runs `python <args>` from the repository on 8 fake CPU devices (unless XLA_FLAGS says otherwise), its output in
  out.parent/<out.name>.log; exits with the log's tail if it fails. Returns the seed, wall time and load around it."""
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu", **os.environ,
         "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
  out.mkdir(parents=True, exist_ok=True)
  log = out.parent / f"{out.name}.log"
  load_before = os.getloadavg()[0]
  start = time.perf_counter()
  with open(log, "w") as f:
    code = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
  wall = time.perf_counter() - start
  if code:
    sys.exit(f"seed {seed}: {' '.join(args)} exited {code}:\n{log.read_text()[-3000:]}")
  return {"seed": seed, "wall_s": wall, "load_before": load_before, "load_after": os.getloadavg()[0]}


def run_one(command: str, seed: int, out: pathlib.Path, overrides: list[str]) -> dict:
  args = ["-m", f"maxctx.{command}", CONFIG, f"run.seed={seed}", f"run.output_dir={out}", *overrides]
  if command == "eval":
    args += ["--train", *SWEEP]
  row = run_logged(args, seed, out)
  row["during"] = _scalars(out / "tensorboard", "eval/passkey/128")
  if command == "eval":
    row["final"] = sweep_accuracy(out / "eval")
  return row


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--command", choices=("eval", "train"), default="eval")
  p.add_argument("--out", help="keep each run's output in DIR/seed<N> and its log in DIR/seed<N>.log (default: a "
                 "temporary directory)")
  p.add_argument("overrides", nargs="*")
  args = p.parse_args()
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
  with tempfile.TemporaryDirectory() as tmp:
    base = pathlib.Path(args.out or tmp)
    rows = [run_one(args.command, int(s), base / f"seed{s}", args.overrides) for s in args.seeds.split(",")]
  print(f"passkey demo, `{args.command}` command, at {commit.strip() or 'an unknown commit'}")
  steps = [s for s, _ in rows[0]["during"]]
  lengths = list(rows[0].get("final", {}))
  print("| seed | " + " | ".join(f"@128 step {s}" for s in steps) + "".join(f" | final @{n}" for n in lengths)
        + " | wall | load before / after |")
  print("|---" * (2 + len(steps) + len(lengths)) + "|---|")
  for r in rows:
    cells = [f"{100 * a:.0f}%" for _, a in r["during"]] + [f"{100 * a:.0f}%" for a in r.get("final", {}).values()]
    print(f"| {r['seed']} | " + " | ".join(cells) + f" | {r['wall_s'] / 60:.1f} min | "
          f"{r['load_before']:.1f} / {r['load_after']:.1f} |")


if __name__ == "__main__":
  main()
