"""The run-directory lock: who holds it, when it is stale, and what a run that stops before training leaves behind.

The command-line path (a second run refused while the first trains, a SIGKILLed run's lock taken over) is in
test_faults.py; here the holders that one machine cannot produce for real: another host, fresh or silent for long.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from maxctx import run_dir
from maxctx.errors import ConfigError


def _lock(path, **fields) -> None:
  record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": run_dir._process_start(os.getpid()),
            "since": time.time() - 60, "processes": 1, **fields}
  path.mkdir(parents=True, exist_ok=True)
  (path / run_dir.LOCK).write_text(json.dumps(record))


def _files(root):
  return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_live_holder_on_this_host_is_refused_and_nothing_is_touched(tmp_path):
  _lock(tmp_path)
  before = _files(tmp_path)
  with pytest.raises(ConfigError, match=rf"is in use by another run, pid {os.getpid()} on {socket.gethostname()}"):
    with run_dir.RunDir(str(tmp_path)):
      pass
  assert _files(tmp_path) == before


def test_a_dead_or_reused_pid_on_this_host_is_stale(tmp_path):
  for fields in ({"pid": 2**22 + 12345}, {"pid_start": "1"}):  # No such process; this pid, started at another time.
    _lock(tmp_path, **fields)
    with run_dir.RunDir(str(tmp_path)):
      assert json.loads((tmp_path / run_dir.LOCK).read_text())["pid"] == os.getpid()
    assert not (tmp_path / run_dir.LOCK).exists()


def test_another_hosts_lock_is_stale_only_after_its_heartbeat_stops(tmp_path):
  _lock(tmp_path, host="elsewhere", pid=1, processes=4)
  with pytest.raises(ConfigError, match=r"pid 1 on elsewhere \(a job of 4 processes\)"):
    with run_dir.RunDir(str(tmp_path)):
      pass
  old = time.time() - run_dir.STALE_S - 60
  os.utime(tmp_path / run_dir.LOCK, (old, old))
  with run_dir.RunDir(str(tmp_path)):
    pass


def test_a_run_stopped_before_training_removes_what_it_wrote(tmp_path):
  kept = tmp_path / "kept"
  kept.mkdir()
  (kept / "config.yml").write_text("the previous run's\n")
  (kept / "tensorboard").mkdir()
  (kept / "tensorboard" / "events.1").write_text("old\n")
  fresh = tmp_path / "a" / "b"
  for out in (kept, fresh):
    before = _files(out) if out.exists() else None
    with pytest.raises(RuntimeError), run_dir.RunDir(str(out)):
      (out / "config.yml").write_text("this run's\n")
      (out / "tensorboard").mkdir(exist_ok=True)
      (out / "tensorboard" / "events.2").write_text("new\n")
      raise RuntimeError("stopped before its first step")
    assert (_files(out) if out.exists() else None) == before
  assert not (tmp_path / "a").exists()


def test_unusable_directories_are_refused_before_anything_is_created(tmp_path):
  (tmp_path / "file").write_text("x")
  with pytest.raises(ConfigError, match="is a file"):
    run_dir.check_writable(str(tmp_path / "file"))
  with pytest.raises(ConfigError, match="which is not a directory"):
    run_dir.check_writable(str(tmp_path / "file" / "run"))
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "checkpoints").write_text("x")
  with pytest.raises(ConfigError, match="holds a file checkpoints"):
    run_dir.check_writable(str(tmp_path / "run"))


def test_abandon_removes_what_the_run_wrote_and_its_lock(tmp_path):
  # SIGTERM during the first compile calls abandon from a watcher thread, then ends the process (test_faults.py).
  kept = tmp_path / "kept"
  kept.mkdir()
  (kept / "config.yml").write_text("the previous run's\n")
  before = _files(kept)
  for out in (kept, tmp_path / "new" / "run"):
    held = run_dir.RunDir(str(out)).__enter__()
    (out / "config.yml").write_text("this run's\n")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.1").write_text("new\n")
    held.abandon()
    held.__exit__(None, None, None)  # Nothing left to do.
  assert _files(kept) == before and not (tmp_path / "new").exists()


def test_the_lock_holds_the_resolved_directory(tmp_path):
  # Two names of one directory are one run directory: the second is refused while the first holds it.
  (tmp_path / "run").mkdir()
  (tmp_path / "alias").symlink_to(tmp_path / "run")
  with run_dir.RunDir(str(tmp_path / "alias")):
    assert (tmp_path / "run" / run_dir.LOCK).exists()
    with pytest.raises(ConfigError, match="is in use by another run"):
      with run_dir.RunDir(str(tmp_path / "run" / ".")):
        pass


def test_files_of_a_run_that_escape_its_directory_are_refused(tmp_path, monkeypatch):
  other = tmp_path / "other" / "checkpoints"
  other.mkdir(parents=True)
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.yml").symlink_to(tmp_path / "other" / "config.yml")  # dangling: it would be created there
  with pytest.raises(ConfigError, match=r"holds config.yml as a link to .*other/config.yml"):
    run_dir.check_writable(str(run))
  (run / "config.yml").unlink()
  # A bind mount of another directory onto run/checkpoints (read from the mount table; mounting needs privileges).
  (run / "checkpoints").mkdir()
  table = tmp_path / "mountinfo"
  mount_point = str(run / "checkpoints").replace(" ", "\\040")   # the table escapes spaces
  table.write_text(f"22 27 0:21 / /proc rw - proc proc rw\n45 27 254:0 {other} {mount_point} rw - ext4 /dev/vda rw\n")
  monkeypatch.setattr(run_dir, "MOUNTINFO", str(table))
  with pytest.raises(ConfigError, match=rf"holds checkpoints as a bind mount of {other}"):
    run_dir.check_writable(str(run))
  table.write_text(f"45 27 254:0 / {run / 'checkpoints'} rw - ext4 /dev/vdb rw\n")  # a whole disk: the run's own
  run_dir.check_writable(str(run))


def test_maxctx_own_directories_are_refused():
  package = run_dir._PACKAGE
  for name in (str(package / "runs"), str(package.parent / "configs"), str(package.parent / "configs" / "a" / "b")):
    with pytest.raises(ConfigError, match=r"is inside (the maxctx package|the repository's configs directory)"):
      run_dir.check_writable(name)
