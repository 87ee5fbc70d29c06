"""Does the measured plan pick what a maxctx.bench sweep of the same run finds fastest? (issue 18, acceptance 2)

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu .venv/bin/python scripts/bench_plan_measured.py \
        [configs/bench.yml] [--lengths 512,1k,2k,4k] [--out runs/plan-vs-bench] [--reuse]

Runs, each as its own process, one after the other:
  1. python -m maxctx.plan CONFIG --lengths L --out OUT/plan                (measured mode: every candidate timed)
  2. python -m maxctx.bench CONFIG --lengths L --rounds 3 --steps 2 --also OUT/plan/recipe-<L>.yml ... --out OUT/bench
     (the sweep: each strategy on the run's mesh, and each length's pick as its recipe stands; a length's runs are
     timed in 3 turns, every other turn in the opposite order, so the pick and the sweep's cases meet the same host)
Then prints, per length, the plan's pick, its tokens/s in the sweep, the best tokens/s of the sweep, their ratio and
whether it is within 15%, and writes OUT/summary.json. With --reuse, a step whose output exists is not run again.
On fake CPU devices timings rank overheads on this host, not accelerator speed, and move between runs (docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import yaml

MARK = 0.85   # the pick's tokens/s in the sweep, at least this share of the best


def _records(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mesh(sizes: dict[str, int]) -> str:
  return " × ".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "1 device"


def _run(args: list[str], out: pathlib.Path, reuse: bool) -> None:
  if reuse and out.exists():
    return
  print("$", " ".join(args), flush=True)
  subprocess.run([sys.executable, "-m", *args, "--out", str(out)], check=True)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("config", nargs="?", default="configs/bench.yml")
  p.add_argument("--lengths", default="512,1k,2k,4k")
  p.add_argument("--out", default="runs/plan-vs-bench")
  p.add_argument("--reuse", action="store_true", help="do not run a step whose output directory exists")
  args = p.parse_args(argv)
  if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    print("set XLA_FLAGS=--xla_force_host_platform_device_count=8 and JAX_PLATFORMS=cpu (see the docstring)",
          file=sys.stderr)
    return 2
  out = pathlib.Path(args.out)
  _run(["maxctx.plan", args.config, "--lengths", args.lengths], out / "plan", args.reuse)
  picks = [r for r in _records(out / "plan" / "plan.jsonl") if r.get("rank") == 1]
  # maxctx.plan writes recipe.yml for one length, recipe-<length>.yml for each of several.
  recipes = {p["length"]: next(f for f in (out / "plan" / f"recipe-{p['length']}.yml", out / "plan" / "recipe.yml")
                               if f.exists()) for p in picks}
  also = [arg for path in recipes.values() for arg in ("--also", str(path))]
  _run(["maxctx.bench", args.config, "--lengths", args.lengths, "--rounds", "3", "--steps", "2", *also],
       out / "bench", args.reuse)
  sweep = [r for r in _records(out / "bench" / "results.jsonl") if r.get("status") == "ok"]
  rows = []
  for pick in picks:
    length = pick["length"]
    runs = [r for r in sweep if r["length"] == length]
    name = f"{yaml.safe_load(recipes[length].read_text())['attention']['strategy']}_{recipes[length].stem}"
    same = [r for r in runs if r["strategy"] == name]
    if not same:
      print(f"{length}: the plan's candidate did not run in maxctx.bench", file=sys.stderr)
      return 1
    best = max(runs, key=lambda r: r["tokens_per_s"])
    got = same[0]["tokens_per_s"]
    rows.append({"length": length, "plan": pick["candidate"], "plan_tokens_per_s": pick["tokens_per_s"],
                 "bench_tokens_per_s": got, "best": f"{best['strategy']} ({_mesh(best['mesh'])})",
                 "best_tokens_per_s": best["tokens_per_s"], "ratio": got / best["tokens_per_s"],
                 "within": got >= MARK * best["tokens_per_s"]})
  print(f"\n| tokens | plan | planning tokens/s | its tokens/s in maxctx.bench | best in maxctx.bench | ratio | "
        f"within {1 - MARK:.0%} |\n|---|---|---:|---:|---|---:|---|")
  for r in rows:
    print(f"| {r['length']} | {r['plan']} | {r['plan_tokens_per_s']:,.0f} | {r['bench_tokens_per_s']:,.0f} | "
          f"{r['best']}: {r['best_tokens_per_s']:,.0f} | {r['ratio']:.2f} | {'yes' if r['within'] else 'no'} |")
  (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
  return 0 if rows and all(r["within"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
