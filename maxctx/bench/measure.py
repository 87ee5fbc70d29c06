"""One benchmark run on the devices present: a few real training steps of `maxctx.trainer.Trainer` on the real data
pipeline, timed, profiled and measured.

The step is compiled once, ahead of the loop (`jit(...).lower(...).compile()`), so the same executable is timed,
traced, and read for its memory and collectives. Steps: `warmup` untimed, then `timed` steps each waited for
(`block_until_ready`) and timed on the host, then `traced` steps under `jax.profiler`. The loss reported is that of
the last step. Step time is the median of the timed steps; tokens/s = global batch × sequence length / step time.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any

import jax

from maxctx import data as data_lib
from maxctx import mesh as mesh_lib
from maxctx import metrics as metrics_lib
from maxctx import hlo as hlo_lib
from maxctx.bench import trace as trace_lib
from maxctx.bench.plan import Case
from maxctx.errors import ConfigError, MaxctxError
from maxctx.trainer import Trainer

log = logging.getLogger("maxctx.bench")


@dataclasses.dataclass(frozen=True)
class Steps:
  warmup: int = 1
  timed: int = 3
  traced: int = 1

  @property
  def total(self) -> int:
    return self.warmup + self.timed + self.traced


def memory_analysis(compiled) -> dict[str, int]:
  """Per-device bytes of the compiled step; the donated state's output aliases its argument and is counted once."""
  mem = compiled.memory_analysis()
  out = {"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
         "alias": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes}
  out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


def runtime_peak_bytes(devices) -> int | None:
  """The largest `peak_bytes_in_use` over the local devices since the process started; None where the backend keeps
  no stats (XLA:CPU)."""
  peaks = []
  for d in devices:
    stats = d.memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
      return None
    peaks.append(int(stats["peak_bytes_in_use"]))
  return max(peaks) if peaks else None


def run(case: Case, steps: Steps) -> dict[str, Any]:
  """Trains `case.config` for `steps.total` steps and returns its record (see maxctx.bench.report for the fields)."""
  config = case.config
  devices = jax.devices()
  mesh = mesh_lib.build_mesh(config.mesh, devices)
  d = config.data
  record: dict[str, Any] = {"mesh": {a: int(s) for a, s in mesh.shape.items()}, "devices": len(devices),
                            "device_kind": devices[0].device_kind,
                            "ulysses_degree": config.attention.ulysses_degree,
                            "tokens_per_step": d.batch_size * d.seq_len,
                            "flops_per_step": metrics_lib.flops_per_step(config.model, d.batch_size, d.seq_len)}
  peak_before = runtime_peak_bytes(jax.local_devices())
  with jax.set_mesh(mesh):
    trainer = Trainer(config, mesh)
    pipeline = data_lib.build(config, mesh)
    state = trainer.init(jax.random.key(config.run.seed))
    batch = next(pipeline)
    start = time.perf_counter()
    compiled = trainer.step.lower(state, batch).compile()
    record["compile_s"] = round(time.perf_counter() - start, 2)
    text = compiled.as_text()
    collectives = hlo_lib.collectives(text, hlo_lib.num_partitions(text, len(devices)))
    record["memory_compiled"] = memory_analysis(compiled)
    record["collective_bytes"] = collectives.summary()

    losses, times = [], []
    for i in range(steps.warmup + steps.timed):
      if i:
        batch = next(pipeline)
      t = time.perf_counter()
      state, step_metrics = compiled(state, batch)
      jax.block_until_ready(step_metrics)
      times.append(time.perf_counter() - t)
      losses.append(float(step_metrics["loss"]))
    traced_s = 0.0
    with trace_lib.profile(collectives) as profile:
      for _ in range(steps.traced):
        batch = next(pipeline)
        t = time.perf_counter()
        state, step_metrics = compiled(state, batch)
        jax.block_until_ready(step_metrics)
        traced_s += time.perf_counter() - t
        losses.append(float(step_metrics["loss"]))
    peak = runtime_peak_bytes(jax.local_devices())
  # A device's peak counts from the start of the process, and the runs share one; a run's own peak is known only when
  # it raised the peak of the runs before it (the sweep goes from short to long sequences, so most do).
  record["peak_bytes_runtime"] = peak if peak is not None and (peak_before is None or peak > peak_before) else None
  if peak is not None and record["peak_bytes_runtime"] is None:
    record["peak_runtime_note"] = "at most the peak of an earlier run in this process"
  step_s = statistics.median(times[steps.warmup:]) if steps.timed else traced_s / max(steps.traced, 1)
  record.update(step_time_s=step_s, step_times_s=[round(t, 4) for t in times[steps.warmup:]],
                tokens_per_s=record["tokens_per_step"] / step_s, loss=losses[-1], losses=losses,
                traced_steps=steps.traced, traced_s=traced_s)
  # Share of the traced steps' wall time that one device (on average) spent inside collectives.
  wall = max(traced_s, 1e-9)
  record["comm_s_attention"] = profile.attention
  record["comm_s_other"] = profile.other
  record["comm_share"] = sum(profile.attention.values()) / wall
  record["comm_share_all"] = (sum(profile.attention.values()) + sum(profile.other.values())) / wall
  record["comm_share_by_kind"] = {k: v / wall for k, v in profile.attention.items() if v}
  record["profiled_devices"] = profile.devices
  return record


def attempt(case: Case, steps: Steps) -> dict[str, Any]:
  """`run`, with what stops one case recorded instead of raised, so a sweep goes on to the next: a ConfigError is
  "refused" (this case cannot run as configured), any other MaxctxError (e.g. a DataError from the pipeline) or a
  runtime error (e.g. out of memory) is "failed"; `reason` says why in one line."""
  try:
    return {"status": "ok", **run(case, steps)}
  except ConfigError as e:
    return {"status": "refused", "reason": str(e)}
  except MaxctxError as e:
    return {"status": "failed", "reason": str(e)}
  except jax.errors.JaxRuntimeError as e:
    return {"status": "failed", "reason": str(e).splitlines()[0][:300]}
