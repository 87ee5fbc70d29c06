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
import concurrent.futures
import dataclasses
import logging
import os
import pathlib
import sys
import time

import jax
import numpy as np

from maxctx import attention
from maxctx import checkpoint as checkpoint_lib
from maxctx import config as config_lib
from maxctx import console
from maxctx import data as data_lib
from maxctx import distributed
from maxctx import mesh as mesh_lib
from maxctx import metrics as metrics_lib
from maxctx import preemption as preemption_lib
from maxctx import run_dir as run_dir_lib
from maxctx.chips import HOST_MEMORY_SHARE
from maxctx.eval import sweep as eval_sweep
from maxctx.errors import ArgumentParser, ConfigError, MaxctxError, exit_code
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
  directory is written; config.yml, TensorBoard and checkpoints appear only once the state is restored or made."""
  devices = jax.devices()
  out_dir = pathlib.Path(config.run.output_dir)
  run_dir_lib.check_writable(config.run.output_dir)
  config = _planned(config, devices, out_dir / "config.yml")
  sizes = validate(config, len(devices), mesh_lib.num_slices_of(devices))
  _check_host_memory(config, sizes)
  mesh = mesh_lib.build_mesh(config.mesh, devices)
  log.info("mesh %s on %d %s device(s)", dict(mesh.shape), len(devices), devices[0].device_kind)

  with jax.set_mesh(mesh), preemption_lib.Preemption() as preemption:
    trainer = Trainer(config, mesh)
    pipeline = data_lib.build(config, mesh)
    pipeline.check_first_batch()
    evaluator = eval_sweep.during_training(config, mesh)  # None unless eval.every_steps; checked before compiling
    if config.checkpoint.load_params:
      checkpoint_lib.check_params(config.checkpoint.load_params, trainer.abstract_state().params)
    # Holding the directory before Checkpoints looks at it: a second run must not clean up the first one's saves.
    with run_dir_lib.RunDir(config.run.output_dir) as run_dir, checkpoint_lib.Checkpoints(config, mesh) as checkpoints:
      preemption.before_start(run_dir.abandon)   # SIGTERM before the first step removes what the run wrote
      state = checkpoints.restore_or_init(trainer, pipeline)
      if jax.process_index() == 0:
        config_lib.save(config, out_dir)
      log.info("resolved config (saved to %s):\n%s", out_dir / "config.yml", config.to_yaml())
      start = int(jax.device_get(state.step))
      if start >= config.run.steps:
        log.info("done already: the checkpoint is at step %d and run.steps is %d; raise run.steps to train on.", start,
                 config.run.steps)
        return Fit([], state)
      with _Reporter(config, len(devices)) as reporter:
        state = _loop(config, trainer, pipeline, evaluator, state, start, checkpoints, preemption, reporter,
                      run_dir)
  if reporter.losses:
    log.info("done: %d steps, final loss %.4f; TensorBoard: tensorboard --logdir %s", len(reporter.losses),
             reporter.losses[-1], out_dir / "tensorboard")
  return Fit(reporter.losses, state)


def _loop(config, trainer, pipeline, evaluator, state, start, checkpoints, preemption, reporter,
          run_dir) -> TrainState:
  """Steps from `start` to run.steps (or a preemption), saving and evaluating as configured; returns the last state."""
  pending = None
  for step in range(start, config.run.steps):
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
    evaluate = evaluator is not None and (done % config.eval.every_steps == 0 or done == config.run.steps)
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
        records = evaluator.run(state.params)
        reporter.writer.scalars(done, eval_sweep.scalars(records))
        log.info("eval at step %d: %s", done, eval_sweep.summary(records))
      reporter.restart_clock()   # the save's or eval's host time is not the next step's
    if stop:
      then = "rerun the same command to continue" if checkpoints.enabled else "a rerun starts over"
      log.info("preempted: stopped after step %d; %s; %s.", done, checkpoints.last_good(), then)
      break
  if pending is not None:
    reporter.report(pending, checkpoints)
  jax.block_until_ready(state)
  return state


def _planned(config: config_lib.Config, devices, saved: pathlib.Path) -> config_lib.Config:
  """`config`, with `attention.strategy: auto` or `model.remat: auto` planned on these devices (or the plan `saved`
  kept, for a resumed run). The planner is a tool that measures candidates here: imported only when a run says `auto`,
  so a run that names its strategy and policy loads none of it (tests/test_imports.py)."""
  if config.attention.strategy != attention.AUTO and config.model.remat != "auto":
    return config
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


def _finished_at(step_metrics) -> float:
  try:
    jax.block_until_ready(step_metrics)
  except Exception:  # noqa: BLE001 — the step's own failure is raised where its metrics are read.
    pass
  return time.perf_counter()


class _Reporter:
  """Reads each step's metrics (after the next step is dispatched) and writes them to the console and TensorBoard.

  A step's time runs from the moment the step before it finished (or the clock restarted) to the moment it finished,
  both seen by a thread that does nothing but wait for each dispatched step. The moment the main thread reads the
  metrics is no clock: it lags whenever dispatch or the host is slow, and the step read right after it at a save
  would then seem to take no time at all.
  """

  def __init__(self, config: config_lib.Config, n_devices: int):
    m, d = config.model, config.data
    self.config, self.n_devices = config, n_devices
    self.flops = metrics_lib.flops_per_step(m, d.batch_size, d.seq_len)
    self.peak, self.peak_source = metrics_lib.peak_tflops_per_device(config.metrics.peak_tflops, m.dtype)
    log.info("model %s: %.3gM parameters; %.3g TFLOP per step; peak %.3g TFLOP/s per device (%s)",
             m.preset or "custom", metrics_lib.param_count(m) / 1e6, self.flops / 1e12, self.peak, self.peak_source)
    out_dir = pathlib.Path(config.run.output_dir)
    self.writer = metrics_lib.Writer(out_dir / "tensorboard" if config.metrics.tensorboard else None,
                                     config.run.steps)
    self.losses: list[float] = []
    self.steady: list[float] = []
    self._clock = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="maxctx-step-clock")
    self._dispatched: dict[int, tuple[dict, concurrent.futures.Future]] = {}
    self.last_time = time.perf_counter()
    self.first = True

  def __enter__(self) -> _Reporter:
    return self

  def __exit__(self, *exc) -> None:
    self._clock.shutdown(wait=True)
    self.writer.close()

  def dispatched(self, step: int, step_metrics: dict) -> None:
    """Step `step` is on its way; its clock stops when it finishes."""
    self._dispatched[step] = (step_metrics, self._clock.submit(_finished_at, step_metrics))

  def logs(self, step: int) -> bool:
    """Whether step `step` (0-based) is written to the console and TensorBoard."""
    n = step + 1
    return n % self.config.metrics.log_every == 0 or n == self.config.run.steps

  def restart_clock(self) -> None:
    """The next step's time counts from now: what the host did since the last step finished was not training."""
    self.last_time = time.perf_counter()

  def report(self, step: int, checkpoints: checkpoint_lib.Checkpoints) -> None:
    """Fetches step `step`'s metrics and logs them; a non-finite step stops the run under run.on_nan=stop."""
    config = self.config
    step_metrics, finished = self._dispatched.pop(step)
    values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
    end = finished.result()
    step_time = end - self.last_time
    self.last_time = end
    if not self.first:  # The first step of a process includes compilation.
      self.steady.append(step_time)
    self.first = False
    if not values.pop("finite"):
      msg = f"step {step + 1}: loss is {values['loss']} (grad norm {values['grad_norm']})"
      if config.run.on_nan == "stop":
        checkpoints.wait()
        raise MaxctxError(f"{msg}; the run stopped and {checkpoints.last_good()}. Lower optim.lr or set "
                          "run.on_nan=skip to skip such updates.")
      log.warning("%s; update skipped (run.on_nan=skip).", msg)
    self.losses.append(values["loss"])
    tokens = config.data.batch_size * config.data.seq_len
    values["step_time"] = step_time
    values["tokens_per_sec"] = tokens / step_time
    values["tflops_per_device"] = self.flops / step_time / self.n_devices / 1e12
    values["mfu"] = values["tflops_per_device"] / self.peak if self.peak else 0.0
    values.pop("tokens")
    n = step + 1
    if self.logs(step):
      if (peak := metrics_lib.peak_memory_gib()) is not None:   # read only on the steps that log it
        values["peak_memory_gib"] = peak
      self.writer.scalars(n, values)
      typical = float(np.median(self.steady)) if self.steady else step_time
      self.writer.console(n, values, typical * (config.run.steps - n))


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
