"""One benchmark run on the devices present: a few real training steps of `maxctx.trainer.Trainer` on the real data
pipeline, timed, profiled and measured.

The step is compiled once, ahead of the loop (`jit(...).lower(...).compile()`), so the same executable is timed,
traced, and read for its memory and collectives. Steps: `warmup` untimed, then `timed` steps each waited for
(`block_until_ready`) and timed on the host, then `traced` steps under `jax.profiler`. The loss reported is that of
the last step. Step time is the median of the timed steps; tokens/s = global batch × sequence length / step time.

`attempt_all` with `rounds` > 1 holds several runs at once (each compiled and warmed up) and times them in turns:
`rounds` rounds of `timed` steps each, every other round in the opposite order. A host whose speed drifts over minutes
(fake CPU devices on shared cores) then slows every run alike instead of whichever happened to run during the slow
minutes, so the runs' ranking is steadier (docs/planner.md, "The benchmark: every strategy at every length").
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any, Callable

import jax

from maxctx import data as data_lib
from maxctx import mesh as mesh_lib
from maxctx import metrics as metrics_lib
from maxctx.bench import trace as trace_lib
from maxctx.bench.cases import Case
from maxctx.compile import hlo as hlo_lib
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


class _Run:
  """One case compiled and warmed up, ready for timed steps (`timed`) and then its profiled steps (`finish`)."""

  def __init__(self, case: Case, steps: Steps):
    config = case.config
    devices = jax.devices()
    self.mesh = mesh_lib.build_mesh(config.mesh, devices)
    d = config.data
    self.record: dict[str, Any] = {
        "mesh": {a: int(s) for a, s in self.mesh.shape.items()}, "devices": len(devices),
        "device_kind": devices[0].device_kind, "ulysses_degree": config.attention.ulysses_degree,
        "tokens_per_step": d.batch_size * d.seq_len,
        "flops_per_step": metrics_lib.flops_per_step(config.model, d.batch_size, d.seq_len)}
    self.peak_before = runtime_peak_bytes(jax.local_devices())
    self.losses: list[float] = []
    self.times: list[float] = []
    with jax.set_mesh(self.mesh):
      trainer = Trainer(config, self.mesh)
      self.pipeline = data_lib.build(config, self.mesh)
      self.state = trainer.init(jax.random.key(config.run.seed))
      self.batch = next(self.pipeline)
      start = time.perf_counter()
      self.compiled = trainer.step.lower(self.state, self.batch).compile()
      self.record["compile_s"] = round(time.perf_counter() - start, 2)
      text = self.compiled.as_text()
      self.collectives = hlo_lib.collectives(text, hlo_lib.num_partitions(text, len(devices)))
      self.record["memory_compiled"] = memory_analysis(self.compiled)
      self.record["collective_bytes"] = self.collectives.summary()
      for _ in range(steps.warmup):
        self._step()

  def _step(self) -> float:
    batch = self.batch if self.batch is not None else next(self.pipeline)
    self.batch = None  # the batch the step was compiled with is the first step's
    t = time.perf_counter()
    self.state, step_metrics = self.compiled(self.state, batch)
    jax.block_until_ready(step_metrics)
    elapsed = time.perf_counter() - t
    self.losses.append(float(step_metrics["loss"]))
    return elapsed

  def timed(self, n: int) -> None:
    with jax.set_mesh(self.mesh):
      self.times.extend(self._step() for _ in range(n))

  def finish(self, steps: Steps, rounds: int, held: int) -> dict[str, Any]:
    record = self.record
    traced_s = 0.0
    with jax.set_mesh(self.mesh), trace_lib.profile(self.collectives) as profile:
      for _ in range(steps.traced):
        traced_s += self._step()
    peak = runtime_peak_bytes(jax.local_devices())
    # A device's peak counts from the start of the process, and the runs share one; a run's own peak is known only
    # when it raised the peak of the runs before it (the sweep goes from short to long sequences, so most do) and no
    # other run was held with it.
    own = peak is not None and held == 1 and (self.peak_before is None or peak > self.peak_before)
    record["peak_bytes_runtime"] = peak if own else None
    if peak is not None and not own:
      record["peak_runtime_note"] = ("at most the peak of an earlier run in this process" if held == 1 else
                                     f"the process's peak, with {held} runs held at once (--rounds)")
    step_s = statistics.median(self.times) if self.times else traced_s / max(steps.traced, 1)
    record.update(step_time_s=step_s, step_times_s=[round(t, 4) for t in self.times],
                  tokens_per_s=record["tokens_per_step"] / step_s, loss=self.losses[-1], losses=self.losses,
                  traced_steps=steps.traced, traced_s=traced_s)
    if rounds > 1:
      record["timed_rounds"] = rounds
    # Share of the traced steps' wall time that one device (on average) spent inside collectives.
    wall = max(traced_s, 1e-9)
    record["comm_s_attention"] = profile.attention
    record["comm_s_other"] = profile.other
    record["comm_share"] = sum(profile.attention.values()) / wall
    record["comm_share_all"] = (sum(profile.attention.values()) + sum(profile.other.values())) / wall
    record["comm_share_by_kind"] = {k: v / wall for k, v in profile.attention.items() if v}
    record["profiled_devices"] = profile.devices
    return record


def _guarded(fn: Callable[[], Any]) -> tuple[Any, dict[str, Any] | None]:
  """fn's value, or what stopped it as a record: a ConfigError is "refused" (this case cannot run as configured), any
  other MaxctxError (e.g. a DataError from the pipeline) or a runtime error (e.g. out of memory) is "failed"; `reason`
  says why in one line."""
  try:
    return fn(), None
  except ConfigError as e:
    return None, {"status": "refused", "reason": str(e)}
  except MaxctxError as e:
    return None, {"status": "failed", "reason": str(e)}
  except jax.errors.JaxRuntimeError as e:
    return None, {"status": "failed", "reason": str(e).splitlines()[0][:300]}


def attempt_all(cases: list[Case], steps: Steps, rounds: int = 1) -> list[dict[str, Any]]:
  """The record of each case (status ok), or why it stopped (`_guarded`), so a sweep goes on to the next case.
  With rounds == 1 each case runs whole before the next starts, and only one is held at a time. With rounds > 1 all
  are held at once and their timed steps run in `rounds` turns of `steps.timed` (module docstring)."""
  if rounds == 1:
    return [attempt(case, steps) for case in cases]
  out: list[dict[str, Any] | None] = [None] * len(cases)
  runs: dict[int, _Run] = {}

  def held_note(error: dict[str, Any], held: int) -> dict[str, Any]:
    # Out of memory with others held may be --rounds' doing, not this run's: say so.
    if error["status"] == "failed" and held > 1:
      error["reason"] += f" ({held} runs held at once, --rounds)"
    return error

  for i, case in enumerate(cases):
    log.info("  building %d/%d: %s at %d tokens", i + 1, len(cases), case.strategy, case.seq_len)
    built, error = _guarded(lambda: _Run(case, steps))
    if error is None:
      runs[i] = built
    else:
      out[i] = held_note(error, len(runs) + 1)
  held = len(runs)
  for r in range(rounds):
    for i in sorted(runs, reverse=bool(r % 2)):
      _, error = _guarded(lambda: runs[i].timed(steps.timed))
      if error is not None:
        out[i] = held_note(error, held)
        del runs[i]
    log.info("  round %d/%d: %d runs timed", r + 1, rounds, len(runs))
  for i in sorted(runs):
    record, error = _guarded(lambda: runs[i].finish(steps, rounds, held))
    out[i] = error or {"status": "ok", **record}
  return out


def run(case: Case, steps: Steps) -> dict[str, Any]:
  """Trains `case.config` for `steps.total` steps and returns its record (see maxctx.bench.report for the fields)."""
  r = _Run(case, steps)
  r.timed(steps.timed)
  return r.finish(steps, 1, 1)


def attempt(case: Case, steps: Steps) -> dict[str, Any]:
  """`run`, with what stops it recorded (`_guarded`) instead of raised, so a sweep goes on to the next case."""
  record, error = _guarded(lambda: run(case, steps))
  return error or {"status": "ok", **record}
