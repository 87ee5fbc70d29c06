"""What checkpointing costs the training loop: the demo's step time with no saving, an async save every step, and (for
contrast) a blocking save every step, over the same number of steps.

  python scripts/bench_checkpoint.py [--steps 30] [--repeats 1] [--json out.json] [section.key=value ...]

Each mode trains the demo from scratch in its own output directory (8 fake CPU devices unless XLA_FLAGS says
otherwise). Step times come from the run's TensorBoard `step_time`, which leaves out the time the loop spends inside
a save (maxctx.train restarts its clock after one); step 1 holds compilation and is left out. `loop s` is the wall
time of steps 2..N: their step times plus the save calls made after them; `overhead` compares it with no saving.
`loop waits per save` is the median time a Checkpoints.save call holds the loop (the first save, which sets Orbax up,
is left out). With --repeats each figure is the median over runs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")   # before JAX is imported
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from maxctx import checkpoint  # noqa: E402
from maxctx import config as config_lib  # noqa: E402
from maxctx import train  # noqa: E402

MODES = {
    "no saving": ["checkpoint.every_steps=0"],
    "async save every step": ["checkpoint.every_steps=1", "checkpoint.async_save=true"],
    "blocking save every step": ["checkpoint.every_steps=1", "checkpoint.async_save=false"],
}


def _step_times(logdir: pathlib.Path) -> list[float]:
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(str(logdir))
  acc.Reload()
  return [e.value for e in acc.Scalars("step_time")]


def _size(directory: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


class _TimedSaves:
  """Times each Checkpoints.save call: what the loop waits per save, steadier than step times on a busy machine."""

  def __init__(self):
    self.seconds: list[float] = []
    self._save = checkpoint.Checkpoints.save

  def __enter__(self):
    timed = self

    def save(ckpt, *args, **kwargs):
      t = time.perf_counter()
      out = timed._save(ckpt, *args, **kwargs)
      timed.seconds.append(time.perf_counter() - t)
      return out

    checkpoint.Checkpoints.save = save
    return self

  def __exit__(self, *exc):
    checkpoint.Checkpoints.save = self._save


def bench(steps: int, overrides: list[str], root: pathlib.Path, repeats: int = 1) -> list[dict]:
  # Modes take turns (the order rotates each round), so a machine shared with other work slows them alike.
  runs: dict[str, list[dict]] = {name: [] for name in MODES}
  names = list(MODES)
  for r in range(repeats):
    for name in names[r % len(names):] + names[:r % len(names)]:
      out = root / f"{name.replace(' ', '_')}_{r}"
      config = config_lib.load("configs/demo.yml", [f"run.output_dir={out}", f"run.steps={steps}",
                                                    "metrics.log_every=1", "checkpoint.keep=2", *overrides,
                                                    *MODES[name]])
      with _TimedSaves() as saves:
        train.run(config)
      times = _step_times(out / "tensorboard")[1:]
      step_dir = out / "checkpoints" / str(steps)
      # Saves after steps 2..N: the loop waited in them, and step_time does not count that wait.
      waits = saves.seconds[1:]
      runs[name].append({"median_step_s": float(np.median(times)), "mean_step_s": float(np.mean(times)),
                         "loop_s": float(np.sum(times) + np.sum(waits)),
                         "save_call_s": float(np.median(waits)) if waits else 0.0,
                         "checkpoint_mb": _size(step_dir) / 2**20 if step_dir.exists() else 0.0})
  rows = [{"mode": name, "steps": steps, "repeats": repeats,
           **{k: float(np.median([x[k] for x in runs[name]])) for k in runs[name][0]}} for name in names]
  base = rows[0]["loop_s"]
  for r in rows:
    r["overhead"] = r["loop_s"] / base - 1
  return rows


def table(rows: list[dict]) -> str:
  lines = ["| mode | steps | median step s | mean step s | loop s (steps 2..N) | overhead | loop waits per save s "
           "| checkpoint MB |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['mode']} | {r['steps']} | {r['median_step_s']:.3f} | {r['mean_step_s']:.3f} | "
                 f"{r['loop_s']:.2f} | {100 * r['overhead']:+.1f}% | {r['save_call_s']:.3f} | "
                 f"{r['checkpoint_mb']:.1f} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--repeats", type=int, default=1, help="runs per mode, taking turns; medians are reported")
  parser.add_argument("--json", help="also write the rows to this file")
  parser.add_argument("overrides", nargs="*", help="section.key=value for every mode, e.g. data.seq_len=256")
  args = parser.parse_args(argv)
  train.setup_logging()
  with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as root:
    rows = bench(args.steps, args.overrides, pathlib.Path(root), args.repeats)
  print(table(rows))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
