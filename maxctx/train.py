"""Train a model: `python -m maxctx.train configs/demo.yml [section.key=value ...]`.

Reads the config, checks it against the devices and against the checkpoints already in <run.output_dir>, builds the
mesh, data, model and optimizer, resumes or initialises the state (maxctx.checkpoint), and runs the jitted step, writing
loss and MFU to <run.output_dir>/tensorboard and a progress line to the console. Metrics of step i are read after step
i+1 is dispatched, so the host never makes the devices wait; at a save the step's own metrics are read first (the save
waits for that step anyway), so a non-finite step stops the run before its state is saved.

SIGTERM saves at the next step boundary and returns normally (exit 0); rerunning the same command continues from the
newest complete checkpoint with the losses an uninterrupted run would have had. Before the first step is dispatched
there is nothing to save and SIGTERM ends the process at once (maxctx.preemption). The run holds its directory with a
lock for its whole life (maxctx.run_dir).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import sys

import jax

from maxctx import attention
from maxctx import checkpoint as checkpoint_lib
from maxctx import config as config_lib
from maxctx import console
from maxctx import data as data_lib
from maxctx import distributed
from maxctx import mesh as mesh_lib
from maxctx import preemption as preemption_lib
from maxctx import run_dir as run_dir_lib
from maxctx import sharding
from maxctx import stages as stages_lib
from maxctx.reporter import Reporter
from maxctx.chips import HOST_MEMORY_SHARE
from maxctx.scoring import report as eval_report
from maxctx.scoring import sweep as eval_sweep
from maxctx.errors import ArgumentParser, ConfigError, exit_code
from maxctx.trainer import Trainer, TrainState, offloaded_bytes_per_device, validate

log = logging.getLogger("maxctx")


def setup_logging() -> None:
  prefix = f"[process {jax.process_index()}] " if jax.process_count() > 1 else ""
  # Orbax and grain log each file they write at INFO through absl (left at WARNING); maxctx logs one line per save
  # and restore instead.
  console.setup("stdout", prefix=prefix)
  logging.getLogger("absl").addFilter(_reported_by_maxctx)


def _reported_by_maxctx(record: logging.LogRecord) -> bool:
  """Drops Orbax's traceback of a save that failed writing (no space, no permission): the run stops with one sentence
  naming the step instead (checkpoint.Checkpoints.save)."""
  return not (record.exc_info and checkpoint_lib.os_error(record.exc_info[1]))


def run(config: config_lib.Config) -> list[float]:
  """Trains `config` (resuming its checkpoints as checkpoint.resume says); returns the loss of every step it ran."""
  return fit(config).losses


@dataclasses.dataclass
class Fit:
  """What a training run ends with: the loss of every step it ran (none when the checkpoint was already at
  run.steps) and the state it stopped at, whose `step` is below run.steps when a preemption stopped it."""
  losses: list[float]
  state: TrainState


def fit(config: config_lib.Config) -> Fit:
  """`run`, also returning the final state (maxctx.eval --train scores its parameters).

  Everything a user can get wrong (config, data, parameters to load, the run directory) is refused before the run
  directory is written; config.yml, TensorBoard and checkpoints appear only once the state is restored or made.
  With run.stages every stage is checked before anything compiles, and the run goes through them in order."""
  devices = jax.devices()
  out_dir = pathlib.Path(config.run.output_dir)
  run_dir_lib.check_writable(config.run.output_dir)
  config = _planned(config, devices, out_dir / "config.yml")
  validate(config, len(devices), mesh_lib.num_slices_of(devices))
  runs = _Stages(config, devices)
  for stage in runs.plan:
    with stages_lib.named(stage, config):
      _check_host_memory(stage.config, dict(runs.mesh(stage).shape))
  first = runs.plan[0]
  log.info("mesh %s on %d %s device(s)", dict(runs.mesh(first).shape), len(devices), devices[0].device_kind)

  with preemption_lib.Preemption() as preemption:
    runs.check()
    if config.checkpoint.load_params:
      checkpoint_lib.check_params(config.checkpoint.load_params, runs.trainer(first).abstract_state().params)
    # Holding the directory before Checkpoints looks at it: a second run must not clean up the first one's saves.
    with run_dir_lib.RunDir(config.run.output_dir) as run_dir, \
        checkpoint_lib.Checkpoints(config, runs.mesh(first)) as checkpoints:
      preemption.before_start(run_dir.abandon)   # SIGTERM before the first step removes what the run wrote
      state = checkpoints.restore_or_init(runs.trainer_at, runs.restore_data)
      if jax.process_index() == 0:
        config_lib.save(config, out_dir)
      log.info("resolved config (saved to %s):\n%s", out_dir / "config.yml", config.to_yaml())
      start = int(jax.device_get(state.step))
      if start >= config.run.steps:
        more = "add steps to the last of run.stages" if config.run.stages else "raise run.steps"
        log.info("done already: the checkpoint is at step %d and run.steps is %d; %s to train on.", start,
                 config.run.steps, more)
        return Fit([], state)
      with Reporter(config, len(devices)) as reporter:
        for stage in runs.plan:
          if stage.end <= start:
            continue
          state, stopped = runs.run(stage, state, max(start, stage.start), checkpoints, preemption, reporter, run_dir)
          if stopped:
            break
  if reporter.losses:
    log.info("done: %d steps, final loss %.4f; TensorBoard: tensorboard --logdir %s", len(reporter.losses),
             reporter.losses[-1], out_dir / "tensorboard")
  return Fit(reporter.losses, state)


class _Stages:
  """Each stage's mesh, trainer, data and evaluator (a run without run.stages is one stage), and the boundary between
  two stages: the state re-sharded onto the next mesh, each row's documents carried over to the next length, the
  next step compiled at its first call. A run resumed at a boundary takes the same path from the checkpoint there."""

  def __init__(self, config: config_lib.Config, devices):
    self.config, self.devices = config, devices
    self.plan = stages_lib.resolve(config)
    self._meshes, self._trainers, self._evaluators = {}, {}, {}
    self.pipeline = None      # the data of the stage running now
    self._carried = None      # the last stage's data state, when the next stage has no pipeline yet

  def mesh(self, stage: stages_lib.Stage):
    if stage.index not in self._meshes:
      self._meshes[stage.index] = mesh_lib.build_mesh(stage.config.mesh, self.devices)
    return self._meshes[stage.index]

  def trainer(self, stage: stages_lib.Stage) -> Trainer:
    if stage.index not in self._trainers:
      start, steps = stages_lib.schedule_span(self.plan, stage)
      with jax.set_mesh(self.mesh(stage)):
        self._trainers[stage.index] = Trainer(stage.config, self.mesh(stage), start, steps)
    return self._trainers[stage.index]

  def trainer_at(self, step: int) -> Trainer:
    return self.trainer(stages_lib.at(self.plan, step))

  def check(self) -> None:
    """What the first step would find wrong, before the run directory is written: the first stage's first batch,
    and every stage's evaluation sweep (its lengths on its mesh)."""
    first = self.plan[0]
    with jax.set_mesh(self.mesh(first)):
      self.pipeline = data_lib.build(first.config, self.mesh(first))
      self.pipeline.check_first_batch()
    for stage in self.plan:
      with jax.set_mesh(self.mesh(stage)), stages_lib.named(stage, self.config):
        self._evaluators[stage.index] = eval_sweep.during_training(stage.config, self.mesh(stage))
        rows = data_lib.local_rows(sharding.batch_sharding(self.mesh(stage)),
                                   (stage.config.data.batch_size, stage.config.data.seq_len))
        if stage.index and rows != self.pipeline.rows and first.config.data.source not in data_lib.GENERATED:
          was = self.pipeline.rows
          raise ConfigError(f"this process makes batch rows {rows[0]}–{rows[-1]} in this stage but "
                            f"{was[0]}–{was[-1]} in the first, and each row's documents must carry over; give every "
                            "stage the same data×fsdp split of the batch over the processes.")

  def _data(self, stage: stages_lib.Stage):
    """The data of `stage`: the first stage's checked pipeline, or a new one."""
    if stage.index != 0 or self.pipeline is None:
      if self.pipeline is not None:
        self.pipeline.close()
      with jax.set_mesh(self.mesh(stage)):
        self.pipeline = data_lib.build(stage.config, self.mesh(stage))
    return self.pipeline

  def restore_data(self, step: int, saved: dict) -> None:
    """Restores the data position saved after `step` steps into the data of the stage that continues it; a position
    saved by the stage before (a checkpoint at a boundary) is carried over."""
    stage = stages_lib.at(self.plan, step)
    self._data(stage).restore(saved, carry=stages_lib.producer(self.plan, step).index != stage.index)

  def run(self, stage, state, start, checkpoints, preemption, reporter, run_dir) -> tuple[TrainState, bool]:
    """Runs `stage` from step `start`; returns the last state and whether a preemption stopped the run."""
    mesh, trainer = self.mesh(stage), self.trainer(stage)
    checkpoints.on_mesh(mesh)
    if self.config.run.stages:
      reporter.enter(stage.config, stage.index)
      log.info("%s: steps %d–%d at %d tokens, mesh %s, %s attention; compiling its step", stage.name, stage.start,
               stage.end, stage.config.data.seq_len, dict(mesh.shape), stage.config.attention.strategy)
    with jax.set_mesh(mesh):
      if self._carried is not None:   # entering this stage from the last one, in this process
        # Donated: the last stage's copy is freed as this one is made, never both held for the whole stage.
        state = jax.device_put(state, trainer.state_shardings, donate=True)
        self._data(stage).restore(self._carried, carry=True)
        self._carried = None
      state, stopped = _loop(stage, trainer, self.pipeline, self._evaluators.get(stage.index), state, start,
                             checkpoints, preemption, reporter, run_dir)
    if not stopped and stage.index + 1 < len(self.plan):
      self._carried = self.pipeline.state()
    return state, stopped


def _loop(stage, trainer, pipeline, evaluator, state, start, checkpoints, preemption, reporter,
          run_dir) -> tuple[TrainState, bool]:
  """Steps from `start` to the stage's end (or a preemption), saving and evaluating as configured; returns the last
  state and whether a preemption stopped the run."""
  config = stage.config
  pending, stop = None, False
  for step in range(start, stage.end):
    state, step_metrics = trainer.step(state, next(pipeline))
    # shares: host floats over the batches since the last logged step, read (and reset) only on logged steps
    reporter.dispatched(step, {**step_metrics, **(pipeline.shares() if reporter.logs(step) else {})})
    if step == start:
      preemption.started()
    if pending is not None:
      reporter.report(pending, checkpoints)
      run_dir.keep()
    pending = step
    done = step + 1
    stop = preemption.requested(done)
    save = stop or checkpoints.due(done)
    every = config.eval.every_steps
    evaluate = evaluator is not None and ((every > 0 and (done % every == 0 or done == config.run.steps))
                                          or (config.eval.at_stage_end and done == stage.end))
    if save or evaluate:
      # A save or an eval waits for this step's state anyway, so its metrics cost nothing now; and a non-finite
      # step stops the run before its state is saved: every checkpoint holds a good state.
      reporter.report(pending, checkpoints)
      run_dir.keep()
      pending = None
      if save:
        reporter.writer.flush()  # A run killed after this save keeps every step's scalars up to it.
        checkpoints.save(done, state, pipeline.state(), wait=stop)
      if evaluate:
        _evaluate(stage, evaluator, state, done, reporter)
      reporter.restart_clock()   # the save's or eval's host time is not the next step's
    if stop:
      then = "rerun the same command to continue" if checkpoints.enabled else "a rerun starts over"
      log.info("preempted: stopped after step %d; %s; %s.", done, checkpoints.last_good(), then)
      break
  if pending is not None:
    reporter.report(pending, checkpoints)
  jax.block_until_ready(state)
  return state, stop


def _evaluate(stage, evaluator, state, done: int, reporter) -> None:
  """Scores the sweep on the state after `done` steps, logs it to TensorBoard, and at a stage's end (eval.at_stage_end)
  writes its report and heatmaps under <run.output_dir>/eval/."""
  records = evaluator.run(state.params)
  reporter.writer.scalars(done, eval_sweep.scalars(records))
  log.info("eval at step %d: %s", done, eval_sweep.summary(records))
  config = stage.config
  if config.eval.at_stage_end and done == stage.end and jax.process_index() == 0:
    staged = reporter.stage is not None
    where = f"stage-{stage.index + 1}" if staged else f"step-{done}"
    title = (f"maxctx eval: {config.run.name} after {'stage ' + str(stage.index + 1) if staged else 'training'} "
             f"(step {done}, trained at {config.data.seq_len} tokens)")
    out = pathlib.Path(config.eval.output_dir or pathlib.Path(config.run.output_dir) / "eval") / where
    written = eval_report.write(records, out, title)
    log.info("eval: wrote %s", ", ".join(str(p) for p in written))


def _planned(config: config_lib.Config, devices, saved: pathlib.Path) -> config_lib.Config:
  """`config`, with `attention.strategy: auto` or `model.remat: auto` planned on these devices (or the plan `saved`
  kept, for a resumed run). The planner is a tool that measures candidates here: imported only when a run says `auto`,
  so a run that names its strategy and policy loads none of it (tests/test_imports.py)."""
  if config.run.stages or (config.attention.strategy != attention.AUTO and config.model.remat != "auto"):
    return config   # a stage's auto is refused by maxctx.stages.check
  from maxctx.plan import auto
  return auto.resolve(config, devices, saved)


def host_memory_bytes() -> int:
  """The memory this process may use: the machine's RAM, or the container's limit (a GKE pod's) where lower."""
  have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
      text = pathlib.Path(limit).read_text().strip()
    except OSError:
      continue
    if text.isdigit():
      have = min(have, int(text))
  return have


def _check_host_memory(config: config_lib.Config, sizes: dict[str, int]) -> None:
  """`remat: full_offload` parks every layer's (or layer group's) saved input in host memory; refuse before compiling
  if this host's devices would need more than most of its RAM (the kernel would kill the process mid-step instead)."""
  need = offloaded_bytes_per_device(config, sizes) * jax.local_device_count()
  have = host_memory_bytes()
  if need > HOST_MEMORY_SHARE * have:
    raise ConfigError(f"model.remat full_offload would keep {need / 2**20:,.0f} MiB of saved layer inputs in this "
                      f"host's memory, more than {HOST_MEMORY_SHARE:.0%} of its {have / 2**20:,.0f} MiB; save one "
                      "input per pair of layers (model.remat_group=2), or use model.remat=full, more devices on "
                      "mesh.ici.context, or a shorter data.seq_len.")


def _parser() -> argparse.ArgumentParser:
  p = ArgumentParser(prog="python -m maxctx.train", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("config", help="the run's YAML file (e.g. configs/demo.yml)")
  p.add_argument("overrides", nargs="*", help="section.key=value, e.g. run.steps=20")
  distributed.add_flags(p)
  return p


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)

  def body():
    # Before anything touches a device; the logs then name the process.
    distributed.initialize_processes(distributed.options(args))
    setup_logging()
    run(config_lib.load(args.config, args.overrides))

  return exit_code(body)


if __name__ == "__main__":
  sys.exit(main())
