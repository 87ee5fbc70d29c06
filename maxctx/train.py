"""Train a model: `python -m maxctx.train configs/demo.yml [section.key=value ...]`.

Reads the config, checks it against the devices, builds the mesh, data, model and optimizer, and runs the jitted step,
writing loss and MFU to <run.output_dir>/tensorboard and a progress line to the console. Metrics of step i are read
after step i+1 is dispatched, so the host never makes the devices wait.
"""

from __future__ import annotations

import logging
import pathlib
import sys
import time

import jax
import numpy as np

from maxctx import config as config_lib
from maxctx import data as data_lib
from maxctx import mesh as mesh_lib
from maxctx import metrics as metrics_lib
from maxctx.errors import MaxctxError
from maxctx.trainer import Trainer, validate

log = logging.getLogger("maxctx")

USAGE = "usage: python -m maxctx.train CONFIG.yml [section.key=value ...]"


def setup_logging() -> None:
  prefix = f"[process {jax.process_index()}] " if jax.process_count() > 1 else ""
  logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S",
                      stream=sys.stdout, force=True)


def run(config: config_lib.Config) -> list[float]:
  """Trains `config`; returns the loss of every step."""
  devices = jax.devices()
  validate(config, len(devices), mesh_lib.num_slices_of(devices))
  mesh = mesh_lib.build_mesh(config.mesh, devices)
  out_dir = pathlib.Path(config.run.output_dir)
  if jax.process_index() == 0:
    config_lib.save(config, out_dir)
  log.info("resolved config (saved to %s):\n%s", out_dir / "config.yml", config.to_yaml())
  log.info("mesh %s on %d %s device(s)", dict(mesh.shape), len(devices), devices[0].device_kind)

  m, d = config.model, config.data
  flops = metrics_lib.flops_per_step(m, d.batch_size, d.seq_len)
  peak, peak_source = metrics_lib.peak_tflops_per_device(config.metrics.peak_tflops, m.dtype)
  log.info("model %s: %.3gM parameters; %.3g TFLOP per step; peak %.3g TFLOP/s per device (%s)",
           m.preset or "custom", metrics_lib.param_count(m) / 1e6, flops / 1e12, peak, peak_source)

  writer = metrics_lib.Writer(out_dir / "tensorboard" if config.metrics.tensorboard else None, config.run.steps)
  losses: list[float] = []
  with jax.set_mesh(mesh):
    trainer = Trainer(config, mesh)
    pipeline = data_lib.build(config, mesh)
    state = trainer.init(jax.random.key(config.run.seed))
    pending = None
    last_time = time.perf_counter()
    steady: list[float] = []
    for step in range(config.run.steps):
      state, step_metrics = trainer.step(state, next(pipeline))
      if pending is not None:
        last_time = _report(*pending, config, writer, flops, peak, len(devices), last_time, steady, losses)
      pending = (step, step_metrics)
    _report(*pending, config, writer, flops, peak, len(devices), last_time, steady, losses)
    jax.block_until_ready(state)
  writer.close()
  log.info("done: %d steps, final loss %.4f; TensorBoard: tensorboard --logdir %s", len(losses), losses[-1],
           out_dir / "tensorboard")
  return losses


def _report(step, step_metrics, config, writer, flops, peak, n_devices, last_time, steady, losses) -> float:
  """Fetches step `step`'s metrics (the device has moved on to the next step), logs them; returns the fetch time."""
  values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
  now = time.perf_counter()
  step_time = now - last_time
  if step > 0:  # step 0 includes compilation
    steady.append(step_time)
  if not values.pop("finite"):
    msg = f"step {step + 1}: loss is {values['loss']} (grad norm {values['grad_norm']})"
    if config.run.on_nan == "stop":
      raise MaxctxError(f"{msg}; the run stopped. Lower optim.lr or set run.on_nan=skip to skip such updates.")
    log.warning("%s; update skipped (run.on_nan=skip).", msg)
  losses.append(values["loss"])
  tokens = config.data.batch_size * config.data.seq_len
  values["step_time"] = step_time
  values["tokens_per_sec"] = tokens / step_time
  values["tflops_per_device"] = flops / step_time / n_devices / 1e12
  values["mfu"] = values["tflops_per_device"] / peak if peak else 0.0
  values.pop("tokens")
  n = step + 1
  if n % config.metrics.log_every == 0 or n == config.run.steps:
    writer.scalars(n, values)
    typical = float(np.median(steady)) if steady else step_time
    writer.console(n, values, typical * (config.run.steps - n))
  return now


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] in ("-h", "--help"):
    print(USAGE)
    return 0 if argv else 2
  setup_logging()
  try:
    config = config_lib.load(argv[0], argv[1:])
    run(config)
  except MaxctxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
