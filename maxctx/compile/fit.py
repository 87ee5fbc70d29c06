"""Whether a launch may go ahead: the run's checks for the devices a job will have, and proof from a compile that its
step fits the slice's HBM. `python -m maxctx.launch` asks both before it schedules anything on a pod.

A recipe runs as compiled for its own `compile` section (the recipes' table); a launch that changes the step (another
TPU type or slice count, or overrides of its shape) needs the JSON report of a `python -m maxctx.compile ... --json`
of that step that says it fits.
"""

from __future__ import annotations

import json
import pathlib
import shlex

from maxctx import config as config_lib
from maxctx import topology as topology_lib
from maxctx.compile import step as compile_step
from maxctx.compile.report import CompileReport
from maxctx.config import Config
from maxctx.errors import ConfigError


def check_runs_on(config: Config, topo: topology_lib.Topology, num_slices: int) -> None:
  """The checks `maxctx.train` makes at start-up, made now for the devices of `num_slices` × `topo`."""
  try:
    compile_step.validate_for_tpu(config, topo.devices * num_slices, num_slices)
  except ConfigError as e:
    hint = " (or pass --dcn-axis)" if "mesh.dcn" in str(e) else ""
    raise ConfigError(f"the recipe cannot run on {num_slices} × {topo.name} ({topo.devices * num_slices} devices): "
                      f"{str(e).rstrip('.')}{hint}.") from None


def check_fit_is_proven(recipe: pathlib.Path, shown: str, config: Config, overrides: list[str],
                        fit_report: str | None) -> None:
  """Refuses a launch whose step no compile has shown to fit: one that differs from the recipe's own compile section
  (`compile.topology`, `compile.num_slices`: what the recipes were compiled for) without a fit report for it.
  `shown` is the recipe's path as the suggested `maxctx.compile` command names it."""
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
    check = shlex.join(["python", "-m", "maxctx.compile", shown, f"compile.topology={target['topology']}",
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
