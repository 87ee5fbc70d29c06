"""Training on generated passkey examples, for the passkey demo: `python -m maxctx.eval CONFIG --train`.

The run's Trainer (model, CP strategy, optimizer, jitted step) on batches from maxctx.eval.passkey_data, with the
eval.every_steps sweep logged to TensorBoard as eval/<task>/<length>, and the final parameters written to
<run.output_dir>/params (what checkpoint.load_params reads). This stands in for `python -m maxctx.train` until the data
pipeline has a `passkey` source and the training loop runs the sweep; both hooks are one call each into this package.
"""

from __future__ import annotations

import logging
import pathlib
import time
from typing import Any

import jax
from jax.sharding import Mesh

from maxctx import data as data_lib
from maxctx import metrics as metrics_lib
from maxctx import sharding
from maxctx.attention import layout
from maxctx.config import Config
from maxctx.errors import MaxctxError
from maxctx.eval import params as params_lib
from maxctx.eval import passkey_data, sweep as sweep_lib, tasks
from maxctx.trainer import Trainer

log = logging.getLogger("maxctx.eval")


def run(config: Config, mesh: Mesh, sweep: sweep_lib.Sweep | None) -> Any:
  """Trains `config` on passkey rows; returns the final parameters (also saved under run.output_dir/params)."""
  d, out_dir = config.data, pathlib.Path(config.run.output_dir)
  pieces = tasks.Pieces(sweep_lib.tokenizer_for(config))
  shape = (d.batch_size, d.seq_len)
  tasks.generate("passkey", pieces, d.seq_len + 1, 0.0, 0)  # refuses a data.seq_len too short, before compiling
  writer = metrics_lib.Writer(out_dir / "tensorboard" if config.metrics.tensorboard else None, config.run.steps)
  with jax.set_mesh(mesh):
    trainer = Trainer(config, mesh)
    rows = data_lib.local_rows(trainer.batch_shardings, shape)
    context = mesh.shape[sharding.SEQ_AXIS] if config.attention.load_balance else 0

    def batch(step: int):
      host = passkey_data.batch(pieces, config.run.seed, step, rows, d.seq_len)
      if context:
        host = {k: layout.zigzag(v, context, axis=1) for k, v in host.items()}
      return data_lib.to_global(host, rows, trainer.batch_shardings, shape)

    state = trainer.init(jax.random.key(config.run.seed))
    start = last = time.perf_counter()
    previous = None
    for step in range(1, config.run.steps + 1):
      state, step_metrics = trainer.step(state, batch(step - 1))
      # At most two steps in flight: with many queued, XLA:CPU's fake devices can deadlock in a collective (each
      # step's participants hold pool threads that the earlier step's stragglers need).
      if previous is not None:
        jax.block_until_ready(previous)
      previous = step_metrics["loss"]
      if step % config.metrics.log_every == 0 or step == config.run.steps:
        values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
        if not values.pop("finite"):
          raise MaxctxError(f"step {step}: loss is {values['loss']}; the run stopped. Lower optim.lr.")
        now = time.perf_counter()
        values["step_time"] = (now - last) / config.metrics.log_every
        last = now
        writer.scalars(step, {k: v for k, v in values.items() if k != "tokens"})
        log.info("step %d/%d | loss %.4f | %.2fs/step | %.0fs elapsed", step, config.run.steps, values["loss"],
                 values["step_time"], now - start)
      if sweep is not None and config.eval.every_steps > 0 and (
          step % config.eval.every_steps == 0 or step == config.run.steps):
        records = sweep.run(state.params)
        writer.scalars(step, sweep_lib.scalars(records))
        log.info("step %d eval: %s", step, sweep_lib.summary(records))
    params = state.params
  writer.close()
  path = params_lib.save(params, out_dir / "params")
  log.info("trained %d steps in %.0fs; parameters saved to %s", config.run.steps, time.perf_counter() - start, path)
  return params
