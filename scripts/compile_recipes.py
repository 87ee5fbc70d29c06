"""Compile every recipe for its TPU topology and print its per-device memory (docs/results.md, "Recipes compiled for
TPU", records them):

    python scripts/compile_recipes.py [configs/recipes/*14m*.yml ...] [--jobs 2] [--out runs/compile]

Each recipe runs `python -m maxctx.compile RECIPE --json` in its own process (libtpu compiles one program per
process; an 8B step for 128 devices takes minutes), the JSON reports land in --out, and the table is printed from them,
so a rerun with --table-only reprints it without compiling.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(os.path.abspath(__file__)).parent.parent
GIB = 2**30


def compile_one(recipe: pathlib.Path, out: pathlib.Path) -> tuple[pathlib.Path, int]:
  report = out / f"{recipe.stem}.json"
  log = out / f"{recipe.stem}.log"
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="true")
  with report.open("w") as stdout, log.open("w") as stderr:
    rc = subprocess.run([sys.executable, "-m", "maxctx.compile", str(recipe), "--json"], cwd=ROOT, env=env,
                        stdout=stdout, stderr=stderr, check=False).returncode
  return recipe, rc


def row(r: dict) -> str:
  def gib(n):
    return "—" if n is None else f"{n / GIB:.1f}"
  m = r["memory"] or {}
  total = m.get("total", r.get("required_bytes"))
  verdict = "fits" if r["fits"] else f"does not fit (+{gib(r['over_bytes'])} GiB)"
  return (f"| {r['config']} | {r['topology']} | {r['seq_len']:,} | {r['strategy']} | {r['tokens_per_device']:,} | "
          f"{gib(m.get('argument'))} | {gib(m.get('output'))} | {gib(m.get('temp'))} | **{gib(total)}** | "
          f"{r['hbm_per_device_bytes'] / GIB:.1f} | {gib(m.get('host_temp') or 0)} | {verdict} |")


HEADER = ("| recipe | TPU | tokens | strategy | tokens/device | argument GiB | output GiB | temp GiB | total GiB | "
          "HBM GiB | host GiB | |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("recipes", nargs="*", type=pathlib.Path)
  p.add_argument("--jobs", type=int, default=1, help="compiles at once (each needs ~2-4 GiB of RAM and one core)")
  p.add_argument("--out", type=pathlib.Path, default=ROOT / "runs" / "compile")
  p.add_argument("--table-only", action="store_true", help="print the table from the reports already in --out")
  args = p.parse_args(argv)
  recipes = args.recipes or sorted((ROOT / "configs" / "recipes").glob("*.yml"))
  args.out.mkdir(parents=True, exist_ok=True)
  if not args.table_only:
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
      for recipe, rc in pool.map(lambda r: compile_one(r, args.out), recipes):
        print(f"{recipe.name}: {'done' if rc == 0 else f'failed (rc {rc}), see {args.out / recipe.stem}.log'}",
              file=sys.stderr)
  print(HEADER)
  for recipe in recipes:
    report = args.out / f"{recipe.stem}.json"
    try:
      print(row(json.loads(report.read_text())))
    except (OSError, json.JSONDecodeError):
      print(f"| {recipe.stem} | no report: see {args.out / recipe.stem}.log | | | | | | | | | | |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
