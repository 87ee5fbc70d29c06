"""Does this run file fit its TPU slice? Compiles the run's train step for its slice ahead of time, on any machine with
libtpu (the `tpu` extra), and prints what the step needs of the slice (the library: maxctx.compile.step).

    python -m maxctx.compile configs/recipes/llama3.1-8b-14m-ring-tpu7x-128.yml [compile.topology=v5p-128] [--json]

A run file with `attention.strategy: auto` or `model.remat: auto` is planned for the slice first, as
`python -m maxctx.plan --topology` plans (maxctx.plan.auto.resolve_for_slice), and the report is the chosen
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
from maxctx import resume_match, stages, topology
from maxctx.compile import step as compile_step
from maxctx.compile.report import format_report
from maxctx.plan import auto as plan_auto
from maxctx.config import Config
from maxctx.errors import ArgumentParser, exit_code

log = logging.getLogger("maxctx")


def _keys(config: Config, keys: tuple[str, ...]) -> str:
  flat = resume_match.flat(config.to_dict())
  return " ".join(f"{k}={flat[k] if flat[k] is not None else 'null'}" for k in keys)


def _cache(config: Config) -> pathlib.Path:
  """Where the planner caches its compiles: beside the run's output, or, for an output_dir on a bucket, under
  runs/<run.name>/ here (the compile runs on this machine)."""
  base = config.run.output_dir if "://" not in config.run.output_dir else f"runs/{config.run.name}"
  return pathlib.Path(base) / f"plan-{config.compile.topology}"


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
    config = compile_step.load(args.config, args.overrides)
    if config.run.stages:   # each stage is its own step: its length, mesh, strategy and remat
      reports = []
      topo = topology.resolve(config.compile.topology)
      slices = config.compile.num_slices   # every stage checked before any compiles
      compile_step.validate_for_tpu(config, topo.devices * slices, slices)
      for stage in stages.resolve(config):
        log.info("compiling %s (%s, %d tokens) for %s ...", args.config, stage.name, stage.config.data.seq_len,
                 config.compile.topology)
        reports.append(compile_step.compile_for(stage.config))
      print(json.dumps([r.to_json() for r in reports], indent=2) if args.json else
            "\n".join(format_report(r) for r in reports))
      return
    if plan_auto.is_auto(config):
      # The planner for the slice compiles the candidates, the chosen one among them: its report is this command's.
      keys = plan_auto.planned_keys(config)
      config, report = plan_auto.resolve_for_slice(config, _cache(config))
      log.info("planned for %s: %s (set these in the run file to compile the plan without planning again; every "
               "candidate: python -m maxctx.plan %s --topology %s)", config.compile.topology, _keys(config, keys),
               args.config, config.compile.topology)
    else:
      log.info("compiling %s for %s ...", args.config, config.compile.topology)
      report = compile_step.compile_for(config)
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))

  return exit_code(body)


if __name__ == "__main__":
  sys.exit(main())
