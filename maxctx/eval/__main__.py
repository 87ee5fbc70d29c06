"""Long-context evaluation: `python -m maxctx.eval CONFIG [section.key=value ...] [--tasks ...] [--lengths ...] ...`.

    python -m maxctx.eval configs/demo-passkey.yml checkpoint.load_params=runs/demo-passkey/params \\
        --tasks passkey,niah_multikey --lengths 1k,4k,16k --depths 0,0.25,0.5,0.75,1 --samples 8

Scores the parameters of checkpoint.load_params with the run's model, mesh and CP strategy, and writes eval.jsonl,
eval.md and one <task>.png heatmap per task to eval.output_dir (default <run.output_dir>/eval). Flags replace the
matching eval.* keys. `--train` first trains the run as `python -m maxctx.train` does (the passkey demo's config
trains on data.source=passkey), saves the trained parameters to <run.output_dir>/params, and scores those.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys

import jax

from maxctx import config as config_lib
from maxctx import console
from maxctx import mesh as mesh_lib
from maxctx import params_io, sharding, stages
from maxctx import train as train_lib
from maxctx.errors import ArgumentParser, exit_code
from maxctx.eval import params as params_lib
from maxctx.scoring import report, sweep as sweep_lib
from maxctx.trainer import validate

log = logging.getLogger("maxctx.eval")


def _parser() -> argparse.ArgumentParser:
  p = ArgumentParser(prog="python -m maxctx.eval", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("config", help="the run's YAML file (e.g. configs/demo-passkey.yml)")
  p.add_argument("overrides", nargs="*", help="section.key=value, e.g. checkpoint.load_params=DIR")
  p.add_argument("--tasks", help="comma-separated tasks (replaces eval.tasks; '' for task files only)")
  p.add_argument("--lengths", help="comma-separated lengths in tokens, e.g. 1k,4k,16k (replaces eval.lengths)")
  p.add_argument("--depths", help="comma-separated needle depths in [0, 1] (replaces eval.depths)")
  p.add_argument("--samples", type=int, help="examples per (task, length, depth) (replaces eval.samples)")
  p.add_argument("--files", help="comma-separated JSONL task files of {context, question, answer} (eval.files)")
  p.add_argument("--out", help="output directory (replaces eval.output_dir)")
  p.add_argument("--train", action="store_true",
                 help="train the run first, as python -m maxctx.train does, then score what it trained (the demo)")
  return p


def run(config: config_lib.Config, plan: sweep_lib.Plan, out_dir: pathlib.Path, train: bool = False) -> list[dict]:
  devices = jax.devices()
  trained = config
  # With run.stages the parameters are scored as the stage that made them computes (its RoPE, mesh and strategy):
  # the last one after --train, else the one of checkpoint.load_params's step (an import's parameters: the first).
  # Only that stage must suit these devices; --train checks every stage as maxctx.train does.
  done = config.run.steps if train else params_io.steps_done(config.checkpoint.load_params or ".")
  validate(config if train else stages.stage_config(config, done), len(devices), mesh_lib.num_slices_of(devices))
  config = stages.stage_config(config, done)
  mesh = mesh_lib.build_mesh(config.mesh, devices)
  with jax.set_mesh(mesh):
    sweep = sweep_lib.Sweep(config, mesh, plan)  # every example is made and checked here, before compiling
  if train:
    state = train_lib.fit(trained).state
    step = int(jax.device_get(state.step))
    if step < config.run.steps:  # preempted: scoring a half-trained model would report the wrong thing
      log.info("eval: training stopped at step %d of %d, so nothing is scored; rerun the command to continue.", step,
               config.run.steps)
      return []
    params = state.params
    log.info("eval: trained parameters saved to %s",
             params_lib.save(params, pathlib.Path(config.run.output_dir) / "params"))
  with jax.set_mesh(mesh):
    if not train:
      params = params_lib.load(config, sweep.scorer.model, mesh)
    records = sweep.run(params)
  title = f"maxctx eval: {config.run.name} ({config.attention.strategy}, {mesh.shape[sharding.SEQ_AXIS]}-way CP)"
  if jax.process_index() == 0:
    written = report.write(records, out_dir, title)
    log.info("eval: %s", sweep_lib.summary(records))
    log.info("eval: wrote %s", ", ".join(str(p) for p in written))
  return records


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
  # maxctx at INFO; libraries (Orbax logs every array it writes) only when they warn.
  console.setup("stdout", level=logging.WARNING)
  logging.getLogger("maxctx").setLevel(logging.INFO)

  def body():
    config = config_lib.load(args.config, args.overrides)
    plan = sweep_lib.Plan.from_config(config, tasks=args.tasks, lengths=args.lengths, depths=args.depths,
                                      samples=args.samples, files=args.files)
    out_dir = pathlib.Path(args.out or config.eval.output_dir or pathlib.Path(config.run.output_dir) / "eval")
    run(config, plan, out_dir, train=args.train)

  return exit_code(body)


if __name__ == "__main__":
  sys.exit(main())
