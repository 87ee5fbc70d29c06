"""The extension demo as a benchmark: `python -m maxctx.train configs/demo-extend.yml` once per seed, with the sweep
after each stage, the wall time and the load.

  python scripts/bench_extend_demo.py [--seeds 0,1,2] [--out DIR] [--json FILE] [section.key=value ...]

Each seed runs in its own process and output directory (8 fake CPU devices unless XLA_FLAGS says otherwise). The
config's eval.at_stage_end writes each stage's sweep to <run>/eval/stage-<k>/eval.jsonl; the table gives its accuracy
at 128, 256 and 512 tokens after stage 1 and after stage 2, the command's wall time and the 1-minute load average
before and after it (on a shared machine the wall time means little without the load). docs/evaluation.md records
this table; tests/test_demo_extend.py is the guard CI runs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import tempfile

from bench_passkey_demo import ROOT, run_logged, sweep_accuracy  # scripts/ is on sys.path when run as a script

CONFIG = "configs/demo-extend.yml"


def run_one(seed: int, out: pathlib.Path, overrides: list[str]) -> dict:
  row = run_logged(["-m", "maxctx.train", CONFIG, f"run.seed={seed}", f"run.output_dir={out}", *overrides], seed, out)
  stages = sorted((out / "eval").glob("stage-*"), key=lambda p: int(p.name.split("-")[1]))
  return {**row, "stages": [sweep_accuracy(p) for p in stages]}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--out", help="keep each run's output in DIR/seed<N> and its log in DIR/seed<N>.log (default: a "
                 "temporary directory)")
  p.add_argument("--json", help="also write the rows to this JSON file")
  p.add_argument("overrides", nargs="*")
  args = p.parse_args()
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
  with tempfile.TemporaryDirectory() as tmp:
    base = pathlib.Path(args.out or tmp)
    rows = [run_one(int(s), base / f"seed{s}", args.overrides) for s in args.seeds.split(",")]
  print(f"extension demo at {commit.strip() or 'an unknown commit'}" + (f", {' '.join(args.overrides)}"
                                                                          if args.overrides else ""))
  header = [f"stage {k + 1} @{n}" for k, st in enumerate(rows[0]["stages"]) for n in st]
  print("| seed | " + " | ".join(header) + " | wall | load before / after |")
  print("|---" * (1 + len(header)) + "|---|---|")
  for r in rows:
    cells = [f"{100 * a:.0f}%" for st in r["stages"] for a in st.values()]
    print(f"| {r['seed']} | " + " | ".join(cells) + f" | {r['wall_s'] / 60:.1f} min | "
          f"{r['load_before']:.1f} / {r['load_after']:.1f} |")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps({"commit": commit.strip(), "overrides": args.overrides,
                                                   "rows": rows}, indent=1))


if __name__ == "__main__":
  main()
