"""Resuming is exact: after a SIGKILL or a SIGTERM the same command continues with bit-for-bit the losses of an
uninterrupted run (the CPU is deterministic), and a run saved on one mesh continues on another.

Acceptance (issue 5): 1 crash, 2 preemption, 3 reshard. The subprocess runs share one command line, the demo as
shipped (stdlib corpus, ring attention, zigzag layout) with short sequences; each writes its losses to TensorBoard
(float32, as computed), read back one event file per process.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from maxctx import checkpoint, config, data, mesh as mesh_lib, train
from maxctx.attention import layout
from maxctx.trainer import Trainer

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS, EVERY = 20, 5
ARGS = [f"run.steps={STEPS}", f"checkpoint.every_steps={EVERY}", "checkpoint.keep=2", "data.seq_len=64",
        "metrics.log_every=1", "metrics.peak_tflops=1"]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
  # A compilation cache shared by the runs: each process then loads the step instead of compiling it (~20 s on a busy
  # 2-core machine); a cached executable is the same program, so the losses are unchanged.
  return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
              JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _command(out_dir) -> list[str]:
  return [sys.executable, "-m", "maxctx.train", "configs/demo.yml", f"run.output_dir={out_dir}", *ARGS]


def _event_files(out_dir) -> set[pathlib.Path]:
  return set((pathlib.Path(out_dir) / "tensorboard").glob("events.out.tfevents.*"))


def _losses(event_file) -> dict[int, float]:
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(str(event_file))
  acc.Reload()
  return {e.step: e.value for e in acc.Scalars("loss")}


def _run_to_end(out_dir, env) -> tuple[subprocess.CompletedProcess, dict[int, float]]:
  """Runs the command to completion; returns it and the losses this process logged."""
  before = _event_files(out_dir)
  result = subprocess.run(_command(out_dir), capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  (new,) = _event_files(out_dir) - before
  return result, _losses(new)


def _run_until(out_dir, env, step: int, sig: int | None) -> tuple[subprocess.Popen, str, float]:
  """Starts the command and sends `sig` (if any) once it has logged step `step`; returns the process, its output so
  far, and the time the signal was sent."""
  proc = subprocess.Popen(_command(out_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=ROOT)
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if f"step {step}/{STEPS} " in line:
      if sig is not None:
        proc.send_signal(sig)
      return proc, "".join(seen), time.monotonic()
  proc.wait()
  pytest.fail(f"the run ended before step {step}:\n" + "".join(seen[-40:]))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, env) -> dict[int, float]:
  out = tmp_path_factory.mktemp("uninterrupted")
  _, losses = _run_to_end(out, env)
  assert sorted(losses) == list(range(1, STEPS + 1))
  return losses


def _resumed_step(stdout: str) -> int:
  for line in stdout.splitlines():
    if "checkpoint: restored step" in line:
      return int(line.split("checkpoint: restored step")[1].split()[0])
  pytest.fail("the rerun did not restore a checkpoint:\n" + stdout[-3000:])


def _complete_steps(out_dir) -> list[int]:
  """Steps whose save has finished: Orbax renames a step's directory to its number only once every file is down."""
  return sorted(int(p.name) for p in (pathlib.Path(out_dir) / "checkpoints").glob("*") if p.name.isdigit())


def test_sigkill_between_saves_resumes_bit_for_bit(tmp_path, env, uninterrupted):
  kill_after = random.choice([s for s in range(EVERY + 1, 3 * EVERY) if s % EVERY])
  proc, _, _ = _run_until(tmp_path, env, kill_after, None)
  # Saves are asynchronous: on an idle machine the run can pass step `kill_after` before the save before it is
  # down. Kill once one is, so the crash always lands with a complete step behind it (and maybe one half-written).
  deadline = time.monotonic() + 60
  while not _complete_steps(tmp_path) and time.monotonic() < deadline and proc.poll() is None:
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
  complete = _complete_steps(tmp_path)
  assert complete, "no save finished within 60 s"
  result, resumed = _run_to_end(tmp_path, env)
  start = _resumed_step(result.stdout)
  assert start == complete[-1] and start % EVERY == 0, (start, complete, kill_after)
  assert sorted(resumed) == list(range(start + 1, STEPS + 1))
  for step, loss in resumed.items():
    assert loss == uninterrupted[step], f"killed after step {kill_after}, resumed at {start}: step {step} differs"


def test_sigterm_saves_at_the_step_boundary_and_exits_0(tmp_path, env, uninterrupted):
  signal_after = random.choice([s for s in range(3, STEPS - 3) if s % EVERY])
  proc, seen, sent = _run_until(tmp_path, env, signal_after, signal.SIGTERM)
  rest, _ = proc.communicate(timeout=60)
  elapsed = time.monotonic() - sent
  assert proc.returncode == 0, (seen + rest)[-3000:]
  assert elapsed < 30, f"exit took {elapsed:.1f}s after SIGTERM"
  stopped = [l for l in rest.splitlines() if "preempted: stopped after step" in l]
  assert stopped, rest[-3000:]
  at = int(stopped[0].split("preempted: stopped after step")[1].split(";")[0])
  assert signal_after <= at < STEPS
  assert (tmp_path / "checkpoints" / str(at) / "state").is_dir()
  result, resumed = _run_to_end(tmp_path, env)
  assert _resumed_step(result.stdout) == at
  assert sorted(resumed) == list(range(at + 1, STEPS + 1))
  for step, loss in resumed.items():
    assert loss == uninterrupted[step], f"SIGTERM after step {signal_after}, saved at {at}: step {step} differs"


# ---------------------------------------------------------------------------------------------------------------------
# Resharding, in process.

MESHES = {
    "context=8": ["mesh.ici.data=1", "mesh.ici.fsdp=1", "mesh.ici.context=8"],
    "fsdp=2 context=4": ["mesh.ici.data=1", "mesh.ici.fsdp=2", "mesh.ici.context=4"],
    "data=2 context=4": ["mesh.ici.data=2", "mesh.ici.fsdp=1", "mesh.ici.context=4"],
}
RESHARD = ["data.source=synthetic", "data.seq_len=64", "metrics.tensorboard=false", "metrics.log_every=100",
           "checkpoint.every_steps=2"]


def _restored_on(out_dir, mesh_name):
  """The state restore_or_init gives on `mesh_name`, as host arrays, and the pipeline's next batch."""
  c = config.load("configs/demo.yml", [f"run.output_dir={out_dir}", *RESHARD, *MESHES[mesh_name]])
  mesh = mesh_lib.build_mesh(c.mesh)
  with jax.set_mesh(mesh), checkpoint.Checkpoints(c, mesh) as ckpt:
    trainer = Trainer(c, mesh)
    pipeline = data.build(c, mesh)
    state = ckpt.restore_or_init(lambda step: trainer, lambda step, saved: pipeline.restore(saved))
    for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state_shardings)):
      assert leaf.sharding == want
    batch = jax.device_get(next(pipeline))
    if c.attention.load_balance:  # Compared in token order: each mesh lays the batch out for its own context axis.
      batch = {k: layout.unzigzag(v, mesh.shape["context"]) for k, v in batch.items()}
    return jax.device_get(state), batch


@pytest.fixture(scope="module")
def saved_on_context8(tmp_path_factory):
  out = tmp_path_factory.mktemp("context8")
  c = config.load("configs/demo.yml", [f"run.output_dir={out}", "run.steps=4", *RESHARD, *MESHES["context=8"]])
  losses = train.run(c)
  assert len(losses) == 4 and (out / "checkpoints" / "4").is_dir()
  return out


@pytest.mark.parametrize("target", ["fsdp=2 context=4", "data=2 context=4"])
def test_reshard_resumes_exact_parameters_and_trains_on(tmp_path, saved_on_context8, target):
  out = tmp_path / "run"
  shutil.copytree(saved_on_context8, out)
  want, want_batch = _restored_on(out, "context=8")
  got, got_batch = _restored_on(out, target)
  assert int(got.step) == 4
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(a, b)
  for k in want_batch:  # The data continues at the same batch, laid out for the new mesh.
    np.testing.assert_array_equal(want_batch[k], got_batch[k])

  c = config.load("configs/demo.yml", [f"run.output_dir={out}", "run.steps=6", *RESHARD, *MESHES[target]])
  losses = train.run(c)
  assert len(losses) == 2 and all(np.isfinite(losses))
  assert (out / "checkpoints" / "6").is_dir()

