"""Faults a user meets mid-run, through the command they run: two runs on one directory, a kill, a checkpoint
directory that stops taking writes, a SIGTERM during the first compile, data with nothing usable in it, a step clock
that reads the wrong moment, and a demo corpus that differs between Pythons (issue 15).

Each test starts `python -m maxctx.train` (through tests/faults/inject.py where the fault cannot be made for real: the
tests run as root, on one disk). Timeouts on the subprocesses only guard against a hang; nothing asserts a speed.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
INJECT = str(ROOT / "tests" / "faults" / "inject.py")
SHORT = ["data.seq_len=64", "metrics.log_every=1", "metrics.peak_tflops=1"]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
  # A compilation cache shared by the runs (see test_resume.py): a cached executable is the same program.
  return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
              JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _train(out, *args, fault: str | None = None) -> list[str]:
  head = [sys.executable, INJECT, fault, "maxctx.train"] if fault else [sys.executable, "-m", "maxctx.train"]
  return [*head, "configs/demo.yml", f"run.output_dir={out}", *SHORT, *args]


def _run(command, env, timeout=600) -> subprocess.CompletedProcess:
  return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def _wait_for(proc: subprocess.Popen, log: pathlib.Path, pattern: str, timeout: float = 600) -> None:
  deadline = time.monotonic() + timeout
  while not re.search(pattern, log.read_text(errors="replace")):
    assert proc.poll() is None, f"exited {proc.returncode} before {pattern!r}:\n{log.read_text()[-3000:]}"
    assert time.monotonic() < deadline, f"no {pattern!r} within {timeout}s:\n{log.read_text()[-3000:]}"
    time.sleep(0.2)


def _scalars(out_dir, tag: str) -> dict[int, float]:
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  values = {}
  for f in sorted((pathlib.Path(out_dir) / "tensorboard").glob("events.out.tfevents.*")):
    acc = EventAccumulator(str(f))
    acc.Reload()
    if tag in acc.Tags()["scalars"]:
      values.update({e.step: e.value for e in acc.Scalars(tag)})
  return values


def _one_sentence(result: subprocess.CompletedProcess) -> str:
  assert result.returncode == 2, (result.returncode, result.stderr[-3000:], result.stdout[-3000:])
  assert "Traceback" not in result.stdout + result.stderr, (result.stdout + result.stderr)[-5000:]
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  return lines[0]


def _steps(out_dir) -> list[int]:
  return sorted(int(p.name) for p in (pathlib.Path(out_dir) / "checkpoints").iterdir() if p.name.isdigit())


# -- 1 and 6: one run per directory; a killed run's lock is stale; TensorBoard survives a SIGKILL up to the save.


def test_second_run_on_a_held_directory_is_refused_and_a_killed_runs_lock_is_taken_over(tmp_path, env):
  out, log = tmp_path / "run", tmp_path / "first.log"
  with open(log, "w") as f:
    first = subprocess.Popen(_train(out, "run.steps=200", "checkpoint.every_steps=2"), stdout=f,
                             stderr=subprocess.STDOUT, env=env, cwd=ROOT)
  try:
    _wait_for(first, log, r"checkpoint: saving step 4 ")
    second = _run(_train(out, "run.steps=200", "checkpoint.every_steps=2"), env, timeout=300)
    sentence = _one_sentence(second)
    assert f"is in use by another run, pid {first.pid} on " in sentence, sentence
    assert "step 1/" not in second.stdout  # It trained nothing.
    assert first.poll() is None  # The first run goes on, its saves untouched.
    _wait_for(first, log, r"checkpoint: saving step 8 ")
  finally:
    first.kill()
    first.wait()
  assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1  # Only the first run wrote scalars.
  saved = _steps(out)
  # The rerun finds the killed run's lock stale, takes it over and resumes from the newest complete step; the
  # killed run's TensorBoard holds every step up to that step (scalars are flushed at each save).
  logged = set(_scalars(out, "loss"))
  rerun = _run(_train(out, "run.steps=10", "checkpoint.every_steps=2"), env)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert "taking over the stale lock of pid" in rerun.stdout, rerun.stdout[-3000:]
  resumed = int(re.search(r"checkpoint: restored step (\d+)", rerun.stdout).group(1))
  assert resumed in saved and set(range(1, resumed + 1)) <= logged, (resumed, sorted(logged))
  assert not (out / "maxctx.lock").exists()


# -- 2: data.bad_records=skip over data with no usable record stops, and counts each record once.


def test_skip_with_no_usable_record_stops_and_counts_each_record_once(tmp_path, env):
  data = tmp_path / "d.jsonl"
  data.write_text("".join(json.dumps({"body": f"text {i}"}) + "\n" for i in range(30)))
  from maxctx.data import sources, tokenizers
  tok = tokenizers.train_sentencepiece((sources.read_text(f) for f in sources.stdlib_files()[:60]),
                                       tmp_path / "tok.model", 320)
  result = _run(_train(tmp_path / "out", "data.source=jsonl", f"data.path={data}", f"data.tokenizer={tok}",
                       "data.bad_records=skip"), env, timeout=300)
  assert "yields no usable document: none of its 30 records" in _one_sentence(result)
  dropped = re.findall(r"dropped (\S+ line \d+)", result.stdout)
  assert dropped and len(dropped) == len(set(dropped)) <= 30, dropped
  assert not (tmp_path / "out").exists()


# -- 3: a checkpoint directory that stops taking writes stops the run at once, naming the step and the last good one.


@pytest.mark.parametrize("fault, cause", [("unwritable@4", "permission denied"), ("full@4", "the disk is full")])
def test_failed_save_stops_with_one_sentence_and_keeps_the_last_good_step(tmp_path, env, fault, cause):
  out = tmp_path / "run"
  result = _run(_train(out, "run.steps=8", "checkpoint.every_steps=2", fault=fault), env, timeout=240)
  sentence = _one_sentence(result)
  assert f"saving checkpoint step 4 to {out}/checkpoints failed ({cause})" in sentence, sentence
  assert f"the last good checkpoint is step 2 in {out}/checkpoints/2, which is kept" in sentence, sentence
  assert 2 in _steps(out) and 4 not in _steps(out)
  assert not (out / "maxctx.lock").exists()


# -- 6: a step's time is measured from the step's own end, not from when the host reads it.


def test_step_time_holds_the_step_even_when_dispatch_is_synchronous(tmp_path, env):
  # Each step returns only once it has run and slept 0.5 s: the host reads step i's metrics after step i+1 ran, and
  # the step read at a save, right after the one before it, seemed to take no time at all (MFU in the thousands).
  out = tmp_path / "run"
  result = _run(_train(out, "run.steps=5", "checkpoint.every_steps=2", fault="sync-step=0.5"), env)
  assert result.returncode == 0, result.stderr[-3000:]
  times = _scalars(out, "step_time")
  assert sorted(times) == [1, 2, 3, 4, 5]
  assert all(times[s] >= 0.5 for s in (2, 3, 4, 5)), times


# -- 7: SIGTERM before the first step has nothing to save: it ends the process at once and removes what the run wrote.


def test_sigterm_during_the_first_compile_exits_at_once_and_removes_what_the_run_wrote(tmp_path, env):
  out, log = tmp_path / "run", tmp_path / "log"
  with open(log, "w") as f:
    proc = subprocess.Popen(_train(out, "run.steps=3", "checkpoint.every_steps=1"), stdout=f, stderr=subprocess.STDOUT,
                            env=dict(env, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cold")), cwd=ROOT)
  try:
    # config.yml, the lock and TensorBoard's file are written; the first step's compile is next.
    _wait_for(proc, log, r"resolved config \(saved to")
    assert (out / "config.yml").exists() and (out / "maxctx.lock").exists()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
  finally:
    proc.kill()
  text = log.read_text()
  assert proc.returncode == 143, (proc.returncode, text[-3000:])   # as a process killed by SIGTERM
  assert "step 1/" not in text and "checkpoint: saving" not in text, text[-3000:]
  assert not out.exists(), sorted(str(p) for p in out.rglob("*"))   # made by this run, so removed whole


# -- 9: the demo tokenizer is cached by the corpus it was trained on, not by the Python version alone.


def test_stdlib_tokenizer_cache_is_keyed_by_the_corpus(tmp_path, env):
  from maxctx.data import sources
  files = sources.stdlib_files()
  cache = tmp_path / "cache"
  made = []
  for name, chosen in (("a", files[:80]), ("b", files[80:160])):
    stdlib = tmp_path / name
    stdlib.mkdir()
    for f in chosen:
      shutil.copy(f, stdlib / f.name)
    # Parameters that do not exist stop the run after the data, hence the tokenizer, is built.
    result = _run(_train(tmp_path / "out", f"checkpoint.load_params={tmp_path}/none", fault=f"stdlib={stdlib}"),
                  dict(env, MAXCTX_CACHE=str(cache)), timeout=300)
    assert "is not a directory" in _one_sentence(result)
    made.append(sorted(p.name for p in (cache / "tokenizers").glob("*.model")))
  assert len(made[0]) == 1 and len(made[1]) == 2, made
