"""python -m maxctx.compile: compiles a run's train step for its TPU slice and prints the report (maxctx.compile).

    python -m maxctx.compile configs/recipes/llama3.1-8b-14m-ring-tpu7x-128.yml [compile.topology=v5p-128] [--json]

A run file with `attention.strategy: auto` or `model.remat: auto` is planned for the slice first, as
`python -m maxctx.plan --topology` plans (maxctx.plan_auto.resolve_for_slice), and the report is the chosen
candidate's from that plan's compile. The command lives apart from the library because the planner compiles through
the library.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys

from maxctx import console
from maxctx import plan_auto
from maxctx import compile as compile_lib
from maxctx.config import Config
from maxctx.errors import ArgumentParser, exit_code

log = logging.getLogger("maxctx")


def _planned(config: Config) -> str:
  a, ici = config.attention, config.mesh.ici
  u = f" ulysses_degree={a.ulysses_degree}" if a.ulysses_degree else ""
  return (f"attention.strategy={a.strategy}{u} mesh.ici.fsdp={ici.fsdp} mesh.ici.context={ici.context} "
          f"model.remat={config.model.remat} (set them in the run file to compile this plan without planning again)")


def _parser() -> argparse.ArgumentParser:
  p = ArgumentParser(prog="python -m maxctx.compile", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("config", help="the run's YAML file (e.g. a recipe in configs/recipes/)")
  p.add_argument("overrides", nargs="*",
                 help="section.key=value, e.g. compile.topology=v5p-128 compile.num_slices=2 attention.kernel=flash")
  p.add_argument("--json", action="store_true", help="print the report as JSON")
  return p


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
  # The report goes to stdout; progress and libtpu's chatter to stderr, so `--json > report.json` stays clean.
  console.setup("stderr")

  def body():
    config = compile_lib.load(args.config, args.overrides)
    if plan_auto.is_auto(config):
      # The planner for the slice compiles the candidates, the chosen one among them: its report is this command's.
      out = pathlib.Path(config.run.output_dir) / f"plan-{config.compile.topology}"
      config, report = plan_auto.resolve_for_slice(config, out)
      log.info("planned for %s: %s (every candidate: python -m maxctx.plan %s --topology %s)",
               config.compile.topology, _planned(config), args.config, config.compile.topology)
    else:
      log.info("compiling %s for %s ...", args.config, config.compile.topology)
      report = compile_lib.compile_for(config)
    print(json.dumps(report.to_json(), indent=2) if args.json else compile_lib.format_report(report))

  return exit_code(body)


if __name__ == "__main__":
  sys.exit(main())
