"""Launch a recipe on a GKE TPU cluster with XPK (https://github.com/AI-Hypercomputer/xpk):

    python scripts/launch_xpk.py configs/recipes/llama3.1-8b-14m-ring-tpu7x-128.yml --cluster my-cluster \\
        --tpu-type tpu7x-128 --num-slices 1 --image us-docker.pkg.dev/my-project/maxctx/tpu:latest [--dry-run] \\
        [-- run.steps=20 ...]

Builds the `xpk workload create` command that runs `python -m maxctx.train <recipe>` on every host of the slices,
prints it, and runs it unless --dry-run. The recipe is checked against the TPU type first (mesh sizes, slice count,
strategy constraints), so a config that cannot run fails here, not after the pods are scheduled. Fit is checked too:
a recipe runs as compiled for its own `compile` section (the README's table); a launch that changes the step (another
TPU type or slice count, or overrides of its shape) needs `--fit-report`, the JSON of a `maxctx.compile` of that step
that says it fits. The image must hold this repository at its working directory (docker/Dockerfile does), so the
recipe is passed by its repository path.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

ROOT = pathlib.Path(os.path.abspath(__file__)).parent.parent
sys.path.insert(0, str(ROOT))

from maxctx import config as config_lib  # noqa: E402
from maxctx import topology as topology_lib  # noqa: E402
from maxctx.compile import step as compile_step  # noqa: E402
from maxctx.compile.report import CompileReport  # noqa: E402
from maxctx.errors import ConfigError, MaxctxError  # noqa: E402

MAX_WORKLOAD_NAME = 40   # XPK's limit: the JobSet name also names pods and services


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              epilog="Arguments after `--` are section.key=value overrides for the recipe.")
  p.add_argument("recipe", help="a run config under configs/, e.g. configs/recipes/llama3.1-8b-14m-ring-tpu7x-128.yml")
  p.add_argument("--cluster", required=True, help="the GKE cluster XPK created")
  p.add_argument("--tpu-type", help="GKE/XPK TPU type, e.g. tpu7x-128 or v5p-128; default: the recipe's "
                 "compile.topology")
  p.add_argument("--num-slices", type=int, default=1, help="slices (multislice over DCN); the recipe's mesh.dcn sizes "
                 "must multiply to it, or --dcn-axis says which axis spans them")
  p.add_argument("--dcn-axis", choices=("data", "fsdp", "context"), help="set mesh.dcn.<axis>=--num-slices when the "
                 "recipe has no DCN axes of its own")
  p.add_argument("--image", required=True, help="the container image (docker/Dockerfile), pushed where GKE can pull")
  p.add_argument("--workload", help="workload name; default: the recipe name and a timestamp")
  p.add_argument("--output-dir", help="run.output_dir for the job, e.g. gs://bucket/runs (the workload name is "
                 "appended); default: the recipe's")
  p.add_argument("--project", help="Google Cloud project (default: gcloud's)")
  p.add_argument("--zone", help="zone of the cluster (default: gcloud's)")
  p.add_argument("--priority", choices=("very-low", "low", "medium", "high", "very-high"))
  p.add_argument("--max-restarts", type=int, default=0, help="restarts of the whole job after a failure (resume "
                 "from the last checkpoint)")
  p.add_argument("--xpk", default="xpk", help="the xpk executable")
  p.add_argument("--fit-report", metavar="JSON", help="`python -m maxctx.compile RECIPE ... --json` output proving "
                 "that the launched step fits, needed when it differs from the recipe's own compile section")
  p.add_argument("--dry-run", action="store_true", help="print the command and check the recipe; launch nothing")
  if "--" in argv:
    cut = argv.index("--")
    argv, overrides = argv[:cut], argv[cut + 1:]
  else:
    overrides = []
  return p.parse_args(argv), overrides


def workload_name(recipe: pathlib.Path, now: datetime.datetime | None = None) -> str:
  """`<recipe>-<MMDD-HHMM>` in the letters Kubernetes allows, short enough for XPK."""
  stamp = (now or datetime.datetime.now()).strftime("%m%d-%H%M")
  stem = re.sub(r"[^a-z0-9-]+", "-", recipe.stem.lower()).strip("-")
  return f"{stem[:MAX_WORKLOAD_NAME - len(stamp) - 1].rstrip('-')}-{stamp}"


def repo_path(recipe: pathlib.Path) -> str:
  path = recipe.resolve()
  try:
    return str(path.relative_to(ROOT))
  except ValueError:
    raise ConfigError(f"recipe {recipe} is outside the repository ({ROOT}); the image holds only the repository, so "
                      "put the recipe under configs/ and rebuild the image.") from None


def build_command(args: argparse.Namespace, overrides: list[str]) -> tuple[list[str], str]:
  """(the xpk argv, the train command it runs on every host); raises ConfigError if the recipe cannot run there."""
  recipe = pathlib.Path(args.recipe)
  if not recipe.is_file():
    raise ConfigError(f"recipe {args.recipe} does not exist; pass a file such as configs/recipes/"
                      "llama3.1-8b-14m-ring-tpu7x-128.yml.")
  if args.num_slices < 1:
    raise ConfigError(f"--num-slices is {args.num_slices}; a job has at least one slice.")
  workload = args.workload or workload_name(recipe)
  if not re.fullmatch(r"[a-z]([a-z0-9-]*[a-z0-9])?", workload) or len(workload) > MAX_WORKLOAD_NAME:
    raise ConfigError(f"--workload {workload!r} must be lower-case letters, digits and '-', start with a letter and "
                      f"have at most {MAX_WORKLOAD_NAME} characters.")
  train_overrides = list(overrides)
  if args.dcn_axis and args.num_slices > 1:
    train_overrides.append(f"mesh.dcn.{args.dcn_axis}={args.num_slices}")
  if args.output_dir:
    train_overrides.append(f"run.output_dir={args.output_dir.rstrip('/')}/{workload}")
  config = _load(recipe, train_overrides, args.tpu_type, args.num_slices)
  topo = topology_lib.resolve(args.tpu_type or config.compile.topology)
  _check_fits_slices(config, topo, args.num_slices)
  _check_fit_is_proven(recipe, config, train_overrides, args.fit_report)

  train = ["python", "-m", "maxctx.train", repo_path(recipe), *train_overrides]
  command = shlex.join(train)
  xpk = [args.xpk, "workload", "create", "--cluster", args.cluster, "--workload", workload,
         "--tpu-type", topo.name, "--num-slices", str(args.num_slices), "--docker-image", args.image,
         "--max-restarts", str(args.max_restarts), "--command", command]
  for flag, value in (("--project", args.project), ("--zone", args.zone), ("--priority", args.priority)):
    if value:
      xpk += [flag, value]
  return xpk, command


def _load(recipe: pathlib.Path, overrides: list[str], tpu_type: str | None, num_slices: int):
  extra = [f"compile.topology={tpu_type}"] if tpu_type else []
  extra.append(f"compile.num_slices={num_slices}")
  try:
    return compile_step.load(str(recipe), overrides + extra)
  except ConfigError as e:
    if "no TPU topology" in str(e):
      raise ConfigError(f"no TPU type for {recipe}: pass --tpu-type (e.g. tpu7x-128) or add compile.topology to the "
                        "recipe.") from None
    raise


def _check_fits_slices(config, topo: topology_lib.Topology, num_slices: int) -> None:
  """The checks `maxctx.train` makes at start-up, made now for the devices the job will have."""
  from maxctx import trainer
  try:
    compile_step._validate(trainer, config, topo.devices * num_slices, num_slices)
  except ConfigError as e:
    hint = " (or pass --dcn-axis)" if "mesh.dcn" in str(e) else ""
    raise ConfigError(f"the recipe cannot run on {num_slices} × {topo.name} ({topo.devices * num_slices} devices): "
                      f"{str(e).rstrip('.')}{hint}.") from None


def _check_fit_is_proven(recipe: pathlib.Path, config, overrides: list[str], fit_report: str | None) -> None:
  """Refuses a launch whose step no compile has shown to fit: one that differs from the recipe's own compile section
  (`compile.topology`, `compile.num_slices`: what the README's table compiled) without a fit report for it."""
  target = compile_step.step_key(config)
  where = f"{config.compile.num_slices} × {target['topology']}"
  if fit_report is None:
    own = config_lib.load(str(recipe))
    if own.compile.topology:
      try:
        difference = compile_step.first_difference(compile_step.step_key(own), target)
      except ConfigError:   # the recipe's mesh does not fit its own topology: nothing of it was compiled
        difference = ("compile.topology", own.compile.topology, target["topology"])
      if difference is None:
        return
      key, was, now = difference
      why = (f"recipe {recipe} was compiled for {own.compile.num_slices} × {own.compile.topology} (its compile "
             f"section), not for {where}" if key in ("topology", "num_slices") else
             f"this launch changes {key} of recipe {recipe} from {was} to {now}")
    else:
      why = f"recipe {recipe} has no compile.topology, so no compile has checked it"
    check = shlex.join(["python", "-m", "maxctx.compile", repo_path(recipe), f"compile.topology={target['topology']}",
                        f"compile.num_slices={config.compile.num_slices}", *overrides, "--json"])
    raise ConfigError(f"{why}, so nothing shows that it fits in {where}'s HBM; check it with `{check} > fit.json` "
                      "(minutes on one CPU core, no TPU) and pass --fit-report fit.json.")
  try:
    report = CompileReport.from_json(json.loads(pathlib.Path(fit_report).read_text()))
  except (OSError, ValueError, TypeError) as e:
    raise ConfigError(f"--fit-report {fit_report} is not a report of `python -m maxctx.compile ... --json` ({e}); "
                      "write it with that command.") from None
  if report.step is None:
    raise ConfigError(f"--fit-report {fit_report} comes from a maxctx.compile that did not record the step it "
                      "compiled; compile again with this version and pass the new report.")
  if difference := compile_step.first_difference(report.step, target):
    key, was, now = difference
    raise ConfigError(f"--fit-report {fit_report} was compiled with {key}={was}, but this launch has {key}={now}; "
                      "compile the launched step (the same recipe, --tpu-type, --num-slices and overrides) and pass "
                      "that report.")
  if not report.fits:
    over = f" by {report.over_bytes / 2**30:.1f} GiB" if report.over_bytes else ""
    raise ConfigError(f"--fit-report {fit_report} says the step does not fit in {where}'s HBM{over}; choose a "
                      "larger slice, more slices or a lighter config (python -m maxctx.bench --topology compares "
                      "them).")


def main(argv: list[str] | None = None) -> int:
  args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
  try:
    xpk, _ = build_command(args, overrides)
  except MaxctxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(shlex.join(xpk))
  if args.dry_run:
    return 0
  if shutil.which(args.xpk) is None:
    print(f"error: {args.xpk} is not on PATH; install it (pip install xpk) or pass --xpk /path/to/xpk.",
          file=sys.stderr)
    return 2
  return subprocess.run(xpk, check=False).returncode


if __name__ == "__main__":
  sys.exit(main())
