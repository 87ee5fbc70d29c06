"""Multi-host on one CPU: 2 processes × 4 devices joined through a localhost coordinator, with the context axis spanning
both processes, train exactly like 1 process × 8 devices; and when one process dies the other fails fast instead of
waiting on a collective forever.

The file is also the worker: `python tests/test_multiprocess.py OUT.json STEPS [--coordinator=... ...]`.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
OVERRIDES = ["model.preset=tiny", "mesh.ici.fsdp=1", "mesh.ici.context=8", "attention.strategy=ring",
             "attention.kernel=blockwise", "data.seq_len=256", "data.batch_size=2", "metrics.tensorboard=false",
             "metrics.peak_tflops=1.0", "metrics.log_every=1", "optim.warmup_steps=1"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _spawn(out: pathlib.Path, steps: int, devices: int, extra: list[str], log: pathlib.Path) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("MAXCTX_COORDINATOR", None)
  return subprocess.Popen([sys.executable, __file__, str(out), str(steps), *extra], cwd=ROOT, env=env,
                          stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait(procs, timeout: float, logs) -> None:
  deadline = time.monotonic() + timeout
  for p in procs:
    try:
      p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("workers hung; logs:\n" + "\n".join(log.read_text()[-3000:] for log in logs))


def _pair(tmp_path, steps, name):
  port = _free_port()
  procs, logs = [], []
  for i in range(2):
    log = tmp_path / f"{name}{i}.log"
    flags = [f"--coordinator=127.0.0.1:{port}", "--num-processes=2", f"--process-id={i}"]
    procs.append(_spawn(tmp_path / f"{name}{i}.json", steps, 4, flags, log))
    logs.append(log)
  return procs, logs


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  ref_log = tmp_path / "ref.log"
  ref = _spawn(tmp_path / "ref.json", 3, 8, [], ref_log)
  procs, logs = _pair(tmp_path, 3, "mp")
  _wait([ref, *procs], 600, [ref_log, *logs])
  for p, log in zip([ref, *procs], [ref_log, *logs]):
    assert p.returncode == 0, log.read_text()[-3000:]
  want = json.loads((tmp_path / "ref.json").read_text())
  assert want["process_count"] == 1 and len(want["losses"]) == 3
  for i in range(2):
    got = json.loads((tmp_path / f"mp{i}.json").read_text())
    assert (got["process_count"], got["process_index"], got["local_devices"]) == (2, i, 4)
    assert got["mesh_context_processes"] == 2   # the context axis spans both processes
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) <= 1e-6, (got, want)
  # Process 0 speaks for the job in files; every log line names its process.
  assert "[process 1]" in logs[1].read_text()


@pytest.mark.slow
def test_killed_process_fails_the_other_fast(tmp_path):
  procs, logs = _pair(tmp_path, 100_000, "kill")
  deadline = time.monotonic() + 300
  while "step 2/" not in logs[1].read_text():
    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
      for p in procs:
        p.kill()
      pytest.fail("workers did not start training:\n" + "\n".join(log.read_text()[-3000:] for log in logs))
    time.sleep(0.5)
  procs[1].send_signal(signal.SIGKILL)
  killed = time.monotonic()
  try:
    procs[0].wait(90)
  except subprocess.TimeoutExpired:
    procs[0].kill()
    pytest.fail("process 0 still waits 90 s after process 1 died:\n" + logs[0].read_text()[-3000:])
  assert procs[0].returncode != 0
  assert time.monotonic() - killed < 60, logs[0].read_text()[-3000:]


def _worker(argv: list[str]) -> None:
  out, steps, *flags = argv
  from maxctx import config as config_lib
  from maxctx import distributed, train
  rest = distributed.initialize(flags, heartbeat_timeout_s=15)
  assert not rest, rest
  import jax
  jax.config.update("jax_default_matmul_precision", "highest")
  train.setup_logging()
  # One run directory per job: the processes of a job share it, and a second job on it would be refused.
  job = pathlib.Path(out).stem.rstrip("0123456789")
  config = config_lib.load(None, OVERRIDES + [f"run.steps={steps}",
                                              f"run.output_dir={pathlib.Path(out).parent / f'run-{job}'}"])
  losses = train.run(config)
  mesh_processes = {d.process_index for d in jax.devices()}
  pathlib.Path(out).write_text(json.dumps({
      "losses": losses, "process_count": jax.process_count(), "process_index": jax.process_index(),
      "local_devices": jax.local_device_count(), "mesh_context_processes": len(mesh_processes)}))


if __name__ == "__main__":
  _worker(sys.argv[1:])
