"""Time in collectives, from a `jax.profiler` trace of a few steps.

The profiler writes a Chrome trace (`plugins/profile/<run>/<host>.trace.json.gz`). On XLA:CPU every HLO instruction
a device executes is one complete event whose args name the instruction (`hlo_op`), its module (`hlo_module`) and the
device (`device_ordinal`). An event is a collective when its instruction is one of the compiled step's collectives
(maxctx.bench.hlo), so no name is guessed from strings. Other backends' traces were not checked here: an event without
those args is matched by its name (device lines name events after the HLO instruction) and its process taken as the
device. Collective time is summed per kind and per device and divided by the devices seen: the mean time one device
spends inside collectives. The caller divides that by the wall time of the traced steps.

On fake CPU devices a collective's time includes waiting for the slowest participant at the rendezvous, as it does on
an accelerator whose peers are late; with 8 devices sharing 2 cores, that wait is much of it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gzip
import json
import pathlib
import tempfile
from typing import Iterator

import jax

from maxctx.compile.hlo import Collectives


@dataclasses.dataclass
class Profile:
  """Filled in when the `profile` block exits: kind → seconds per device, in the attention scope and elsewhere."""
  attention: dict[str, float] = dataclasses.field(default_factory=dict)
  other: dict[str, float] = dataclasses.field(default_factory=dict)
  devices: int = 0


@contextlib.contextmanager
def profile(step: Collectives) -> Iterator[Profile]:
  """Traces what runs inside the block and, on exit, reads the time spent in `step`'s collectives."""
  result = Profile()
  with tempfile.TemporaryDirectory(prefix="maxctx-bench-trace-") as tmp:
    jax.profiler.start_trace(tmp)
    try:
      yield result
    finally:
      jax.profiler.stop_trace()
    result.attention, result.other, result.devices = collective_seconds(trace_file(pathlib.Path(tmp)), step)


def trace_file(directory: pathlib.Path) -> pathlib.Path:
  """The JSON trace the profiler wrote under `directory` (plugins/profile/<run>/*.trace.json.gz)."""
  found = sorted(directory.rglob("*.trace.json.gz"))
  if not found:
    raise RuntimeError(f"the profiler wrote no trace.json.gz under {directory}")
  return found[0]


def collective_seconds(path: pathlib.Path, step: Collectives) -> tuple[dict[str, float], dict[str, float], int]:
  """(kind → seconds per device in the attention scope, kind → seconds per device elsewhere, devices seen)."""
  with gzip.open(path, "rt") as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  micros = {True: collections.defaultdict(float), False: collections.defaultdict(float)}
  devices = set()
  for e in events:
    args = e.get("args") or {}
    if e.get("ph") != "X" or args.get("hlo_module", step.module) != step.module:
      continue
    found = step.kinds.get(args.get("hlo_op", e.get("name", "")))
    if "hlo_op" in args or found is not None:
      devices.add(args.get("device_ordinal", e.get("pid")))
    if found is not None:
      kind, in_attention = found
      micros[in_attention][kind] += float(e.get("dur", 0.0))
  n = max(len(devices), 1)
  per_device = {scope: {k: v / n / 1e6 for k, v in d.items()} for scope, d in micros.items()}
  return per_device[True], per_device[False], len(devices)
