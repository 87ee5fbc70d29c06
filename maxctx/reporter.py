"""What a training run reports per step: loss, step time, tokens/s and MFU to the console and TensorBoard, read
after the next step is dispatched so that the host never makes the devices wait."""

from __future__ import annotations

import concurrent.futures
import logging
import pathlib
import time

import jax
import numpy as np

from maxctx import checkpoint as checkpoint_lib
from maxctx import config as config_lib
from maxctx import metrics as metrics_lib
from maxctx.errors import MaxctxError

log = logging.getLogger("maxctx")


def _finished_at(step_metrics) -> float:
  try:
    jax.block_until_ready(step_metrics)
  except Exception:  # noqa: BLE001 — the step's own failure is raised where its metrics are read.
    pass
  return time.perf_counter()


class Reporter:
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
    self.stage: int | None = None   # with run.stages, the stage (1-based) logged as the scalar `stage`

  def enter(self, config: config_lib.Config, stage: int) -> None:
    """The steps from now on are those of stage `stage` (0-based) of run.stages, whose config is `config`: its
    length sets the tokens and FLOPs per step, and its first step, which compiles, is no steady step."""
    d = config.data
    self.config, self.stage, self.first = config, stage + 1, True
    self.flops = metrics_lib.flops_per_step(config.model, d.batch_size, d.seq_len)

  def __enter__(self) -> Reporter:
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
    if self.stage is not None:
      values["stage"] = self.stage
    n = step + 1
    if self.logs(step):
      if (peak := metrics_lib.peak_memory_gib()) is not None:   # read only on the steps that log it
        values["peak_memory_gib"] = peak
      self.writer.scalars(n, values)
      typical = float(np.median(self.steady)) if self.steady else step_time
      self.writer.console(n, values, typical * (config.run.steps - n))
