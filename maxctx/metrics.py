"""Model FLOPs, MFU, and the two places metrics go: TensorBoard and one console line per step.

MFU = model FLOPs per step / (step time × peak FLOP/s of all devices). Model FLOPs are analytic (design.md):
6 × matmul weights per token, plus causal attention, half of 4·B·T²·N·H per layer, × 3 for forward and backward.
"""

from __future__ import annotations

import logging
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxctx import chips
from maxctx.config import ModelConfig

log = logging.getLogger("maxctx")

def matmul_params(cfg: ModelConfig) -> int:
  """Weights that take part in a matmul per token: every projection and the head (not the embedding lookup)."""
  attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
  mlp = 3 * cfg.d_model * cfg.d_ff
  return cfg.n_layers * (attn + mlp) + cfg.d_model * cfg.vocab_size


def param_count(cfg: ModelConfig) -> int:
  norms = (2 * cfg.n_layers + 1) * cfg.d_model
  return matmul_params(cfg) + cfg.vocab_size * cfg.d_model + norms


def flops_per_step(cfg: ModelConfig, batch_size: int, seq_len: int) -> float:
  """Analytic training FLOPs of one optimizer step over batch_size sequences of seq_len tokens."""
  weights = 6.0 * matmul_params(cfg) * batch_size * seq_len
  attention = cfg.n_layers * 3 * (4.0 * batch_size * seq_len**2 * cfg.n_heads * cfg.head_dim / 2)
  return weights + attention


def measured_cpu_peak_tflops(dtype=jnp.float32, n: int = 1024, reps: int = 5) -> float:
  """Per-device matmul TFLOP/s measured with every local device busy at once (fake CPU devices share cores)."""
  devices = jax.local_devices()
  mesh = jax.sharding.Mesh(np.asarray(devices), ("d",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  x = jax.device_put(jnp.ones((len(devices), n, n), dtype), sharding)
  f = jax.jit(lambda a: jnp.einsum("bij,bjk->bik", a, a), out_shardings=sharding)
  f(x).block_until_ready()
  best = math.inf
  for _ in range(reps):
    t = time.perf_counter()
    f(x).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2.0 * n**3 / best / 1e12


def peak_tflops_per_device(override: float = 0.0, compute_dtype=jnp.bfloat16) -> tuple[float, str]:
  """(peak, where it came from): the override, the device table, or a measurement on CPU."""
  if override > 0:
    return override, "metrics.peak_tflops"
  kind = jax.devices()[0].device_kind
  if chip := chips.for_device_kind(kind):
    return chip.tflops_per_device, f"table ({kind})"
  if jax.default_backend() == "cpu":
    return measured_cpu_peak_tflops(compute_dtype), "measured matmul on this CPU"
  log.warning("no peak FLOP/s known for device kind %r; MFU is reported as 0 (set metrics.peak_tflops).", kind)
  return 0.0, f"unknown ({kind})"


def peak_memory_gib() -> float | None:
  """The most device memory any local device has held so far (GiB), where the runtime counts it (GPU, TPU; not the
  CPU: None)."""
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) / 2**30 if peaks else None


class Writer:
  """TensorBoard scalars (process 0 only) and a console progress line.

  Scalars are written to the event file in the calling thread (tensorboardX's SummaryWriter queues them for a worker
  thread, so its flush() is no barrier: a run killed right after a save could lose the scalars of the steps the save
  holds). The file is flushed every FLUSH_SECS and at every `flush()`."""

  FLUSH_SECS = 10.0

  def __init__(self, logdir: pathlib.Path | None, total_steps: int):
    self.total_steps = total_steps
    self._events = None
    if logdir is not None and jax.process_index() == 0:
      from tensorboardX.event_file_writer import EventsWriter
      logdir.mkdir(parents=True, exist_ok=True)
      self._events = EventsWriter(str(logdir / "events"))
    self._start = self._flushed = time.time()

  def scalars(self, step: int, values: dict[str, float]) -> None:
    if self._events is None:
      return
    from tensorboardX import summary
    from tensorboardX.proto.event_pb2 import Event
    now = time.time()
    for k, v in values.items():
      self._events.write_event(Event(wall_time=now, step=step, summary=summary.scalar(k, v)))
    if now - self._flushed > self.FLUSH_SECS:
      self.flush()

  def console(self, step: int, values: dict[str, float], eta_s: float | None) -> None:
    eta = "" if eta_s is None else f" | ETA {_duration(eta_s)}"
    peak = f" | peak {values['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in values else ""
    stage = f"stage {values['stage']:.0f} | " if "stage" in values else ""
    log.info("%sstep %d/%d | loss %.4f | %s tok/s | MFU %.1f%% | step %.3fs | lr %.2e | grad norm %.3f%s%s",
             stage, step, self.total_steps, values["loss"], f"{values['tokens_per_sec']:,.0f}", 100 * values["mfu"],
             values["step_time"], values["learning_rate"], values["grad_norm"], peak, eta)

  def flush(self) -> None:
    """Writes every scalar so far to disk before it returns."""
    if self._events is not None:
      self._events.flush()
      self._flushed = time.time()

  def close(self) -> None:
    if self._events is not None:
      self._events.close()
      self._events = None


def _duration(seconds: float) -> str:
  seconds = int(seconds)
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
