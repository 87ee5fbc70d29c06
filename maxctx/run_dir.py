"""One run per directory: a training run holds <run.output_dir> through a lock file, and leaves nothing behind when
it stops before writing anything of its own.

  <run.output_dir>/maxctx.lock   JSON: host, pid, the process's start time, when the lock was taken, the job's
                                 process count; its modification time is renewed every HEARTBEAT_S seconds

Two runs writing one directory delete each other's in-progress saves and interleave their TensorBoard steps, so a
second run is refused with one sentence naming the holder, touching nothing. A lock is stale, and taken over, when
its holder is gone: on the same host at once (the pid is dead, or now belongs to a process started at another time),
on another host once the heartbeat is older than STALE_S (a lost machine cannot say so). A run stopped by SIGKILL
leaves its lock behind and the next run recognises it as stale this way.

With several processes only process 0 takes the lock, for the whole job, and tells the others whether it got it:
the processes of one job share the directory, those of any other job are refused.

A directory that cannot be written (a file in the way, a read-only filesystem, no permission) is refused here too,
before anything compiles. A run that stops before it has trained a step (a data error in the first batch, say, or a
SIGTERM during the first compile: `abandon`) removes what it wrote: config.yml (or puts the previous one back), its
TensorBoard files, the lock, the directories it made.

The lock holds the resolved directory (run.output_dir may be a link) and all the run writes must lie in it: a
checkpoints/, tensorboard/ or config.yml that is a link or a bind mount could lead into another run, and is refused,
as is a path whose `..` follows a link, or one inside maxctx's package or the repository's configs/.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import socket
import threading
import time

import jax
import numpy as np

from maxctx.config import CONFIG_DIR
from maxctx.errors import ConfigError, MaxctxError

log = logging.getLogger("maxctx")

LOCK = "maxctx.lock"
HEARTBEAT_S = 30
STALE_S = 300
_MESSAGE_BYTES = 2048  # A refusal, broadcast from process 0 to the others.
# What a run writes in its directory, each of which must be the directory's own.
OWN = ("checkpoints", "tensorboard", "config.yml")
_PACKAGE = pathlib.Path(__file__).resolve().parent
# maxctx's own files: a run writing there would mix its files into the package or the recipes.
_PROTECTED = (("the maxctx package", _PACKAGE), ("the repository's configs directory", CONFIG_DIR.resolve()))
MOUNTINFO = "/proc/self/mountinfo"


def _process_start(pid: int) -> str | None:
  """The kernel's start time of `pid` (clock ticks since boot), which tells a live holder from a reused pid."""
  try:
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return None
  return stat.rsplit(")", 1)[1].split()[19]  # Field 22; the command name before it may hold spaces.


def _alive(pid: int, start: str | None) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # Someone else's live process.
  now = _process_start(pid)
  return start is None or now is None or now == start


def _when(seconds: float) -> str:
  return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(seconds))


def _first_existing(path: pathlib.Path) -> pathlib.Path:
  while not path.exists() and path != path.parent:
    if path.is_symlink():  # A dangling link: mkdir would fail on it.
      return path
    path = path.parent
  return path


def resolved(name: str) -> pathlib.Path:
  """The directory `name` names, links and `..` resolved as the filesystem resolves them."""
  return pathlib.Path(os.path.realpath(os.path.expanduser(name)))


def _bind_mounts() -> dict[str, str]:
  """{mount point: the directory of its filesystem mounted there} for the mounts of a part of a filesystem (bind
  mounts); whole filesystems (a disk mounted at its root) are not listed."""
  try:
    text = pathlib.Path(MOUNTINFO).read_text()
  except OSError:
    return {}
  unescape = lambda field: field.encode().decode("unicode_escape").encode("latin-1").decode(errors="replace")
  rows = [line.split() for line in text.splitlines()]
  return {unescape(f[4]): unescape(f[3]) for f in rows if len(f) > 4 and f[3] != "/"}


def check_own(name: str, key: str = "run.output_dir") -> None:
  """Refuses a run directory whose files would not all lie in the directory its lock holds, or that lies in maxctx's
  own files. Creates nothing; URLs (gs://...) are not checked."""
  if "://" in name:
    return
  lexical = pathlib.Path(os.path.abspath(os.path.expanduser(name)))
  real = resolved(name)
  if resolved(str(lexical)) != real:
    raise ConfigError(f"{key} {name} follows a link and then `..` into {real}, not {lexical}; write the directory's "
                      f"own path, so that the run's lock holds the directory it writes.")
  for what, d in _PROTECTED:
    if real == d or d in real.parents:
      raise ConfigError(f"{key} {name} is inside {what} ({d}); use a directory of its own, such as runs/<name>.")
  binds = _bind_mounts()
  for sub in OWN:
    p = real / sub
    if p.is_symlink() or str(p) in binds:
      how = f"a link to {os.path.realpath(p)}" if p.is_symlink() else f"a bind mount of {binds[str(p)]}"
      raise ConfigError(f"{key} {name} holds {sub} as {how}, where the run's lock does not reach (it could be "
                        f"another run's); remove the link or mount, or set {key} to the run directory it belongs to; "
                        f"to keep a run on another disk, put its whole directory there.")


def check_writable(name: str, key: str = "run.output_dir") -> None:
  """Refuses a directory that cannot be created or written, or whose files would escape its lock (`check_own`),
  creating nothing. URLs (gs://...) are not checked."""
  if "://" in name:
    return
  check_own(name, key)
  path = resolved(name)
  base = _first_existing(path)
  if not base.is_dir():
    what = "is a file" if base == path else f"is under {base}, which is not a directory"
    raise ConfigError(f"{key} {name} {what}; point {key} at a directory (new or existing).")
  if base == path:
    for sub in ("checkpoints", "tensorboard"):
      if (path / sub).exists() and not (path / sub).is_dir():
        raise ConfigError(f"{key} {name} holds a file {sub}, where the run keeps its {sub} directory; move it away "
                          f"or use another {key}.")
  if not os.access(base, os.W_OK | os.X_OK):
    why = "is on a read-only filesystem" if _read_only(base) else "is not writable by this user"
    where = f"{base}, where {key} {name} would be created," if base != path else f"{key} {name}"
    raise ConfigError(f"{where} {why}; choose a directory this process can write.")


def _read_only(path: pathlib.Path) -> bool:
  try:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
  except OSError:
    return False


class RunDir:
  """Holds the run directory from `__enter__` to `__exit__`; `keep()` marks that the run has trained a step, after
  which an error no longer removes what it wrote."""

  def __init__(self, name: str):
    self.name = name
    self.url = "://" in name
    self.path = pathlib.Path(name) if self.url else resolved(name)
    self.lock = self.path / LOCK
    self._created: list[pathlib.Path] = []
    self._held = False
    self._kept = False
    self._stop = threading.Event()
    self._before: set[str] = set()
    self._tb_before: set[str] | None = None
    self._config_before: bytes | None = None
    self._beat: threading.Thread | None = None

  def keep(self) -> None:
    self._kept = True

  def __enter__(self) -> RunDir:
    message = ""
    if jax.process_index() == 0:
      try:
        self._acquire()
      except MaxctxError as e:
        message = str(e)
    if jax.process_count() > 1:
      message = _broadcast(message)
    if message:
      raise ConfigError(message)
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    self._stop.set()
    if self._beat is not None:
      self._beat.join()
    if not self._held:
      return
    self._held = False
    try:
      self._remove(self.lock)
    except OSError as e:
      log.warning("could not remove the run's lock %s (%s); the next run will find it stale.", self.lock, e)
    if exc is not None and not self._kept and not self.url:
      self._undo()

  def abandon(self) -> None:
    """The run ends now, before its first step, without unwinding (SIGTERM during the first compile, from another
    thread): removes its lock and what it wrote, as leaving the `with` block on an error would. The process must end
    right after."""
    self._stop.set()
    if not self._held or self._kept:
      return
    self._held = False
    try:
      self._remove(self.lock)
    except OSError:
      pass  # The next run finds it stale.
    if not self.url:
      self._undo()

  def _snapshot(self) -> None:
    self._before = {p.name for p in self.path.iterdir()}
    tb = self.path / "tensorboard"
    self._tb_before = {p.name for p in tb.iterdir()} if tb.is_dir() else None
    config = self.path / "config.yml"
    self._config_before = config.read_bytes() if config.is_file() else None

  def _undo(self) -> None:
    """Removes what this run wrote before it trained a step: config.yml (or its previous text is put back), the
    TensorBoard files it opened, the directories it created. Checkpoints are never touched."""
    try:
      if self._config_before is not None:
        (self.path / "config.yml").write_bytes(self._config_before)
      tb = self.path / "tensorboard"
      if tb.is_dir():
        for p in tb.iterdir():
          if (self._tb_before is None or p.name not in self._tb_before) and p.is_file():
            p.unlink()
      for name in ("config.yml", "tensorboard"):
        p = self.path / name
        if name not in self._before and p.exists():
          p.unlink() if p.is_file() else p.rmdir()
      for d in reversed(self._created):  # Only directories this run made, and only while empty.
        d.rmdir()
    except OSError as e:
      log.warning("could not remove what the stopped run wrote to %s (%s).", self.path, e)

  # -- Taking the lock. --

  def _acquire(self) -> None:
    check_writable(self.name)
    self._mkdirs()
    record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
              "since": time.time(), "processes": jax.process_count()}
    for _ in range(2):
      if self._create(json.dumps(record)):
        self._held = True
        if not self.url:
          self._snapshot()
        self._beat = threading.Thread(target=self._heartbeat, name="maxctx-lock-heartbeat", daemon=True)
        self._beat.start()
        return
      holder = self._holder()
      if holder is None or not self._stale(holder):
        raise ConfigError(self._refusal(holder))
      self._take_over(holder)
    raise ConfigError(self._refusal(self._holder()))

  def _mkdirs(self) -> None:
    if self.url:
      from etils import epath
      epath.Path(self.name).mkdir(parents=True, exist_ok=True)
      return
    missing = []
    p = self.path
    while not p.exists():
      missing.append(p)
      p = p.parent
    for d in reversed(missing):
      try:
        d.mkdir()
      except FileExistsError:
        continue
      except OSError as e:
        raise ConfigError(f"cannot create run.output_dir {self.name} ({e.strerror}: {d}); choose a directory this "
                          "process can write.") from None
      self._created.append(d)

  def _create(self, text: str) -> bool:
    """Writes the lock if none exists; False if one does."""
    if self.url:
      from etils import epath
      lock = epath.Path(self.name) / LOCK
      if lock.exists():  # Object stores have no exclusive create; two runs started together may both pass.
        return False
      lock.write_text(text)
      return True
    try:
      fd = os.open(self.lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
      return False
    except OSError as e:
      why = "disk full" if e.errno == errno.ENOSPC else e.strerror
      raise ConfigError(f"cannot write the lock {self.lock} ({why}); choose a directory this process can write, "
                        "or free space.") from None
    with os.fdopen(fd, "w") as f:
      f.write(text)
    return True

  def _holder(self) -> dict | None:
    try:
      text = self._read(self.lock)
      holder = json.loads(text)
      if not isinstance(holder, dict):
        return None
      holder["beat"] = self._mtime(self.lock)
      return holder
    except (OSError, ValueError):
      return None

  def _stale(self, holder: dict) -> bool:
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
      return not _alive(holder["pid"], holder.get("pid_start"))
    return time.time() - holder.get("beat", time.time()) > STALE_S

  def _take_over(self, holder: dict) -> None:
    log.warning("run.output_dir %s: taking over the stale lock of pid %s on %s (taken %s), whose run is gone.",
                self.name, holder.get("pid"), holder.get("host"), _when(holder.get("since", 0)))
    aside = self.path / f"{LOCK}.stale-{os.getpid()}"
    try:
      if self.url:
        self._remove(self.lock)
        return
      os.rename(self.lock, aside)  # Atomic: of two runs taking over at once, one moves the stale lock.
      if json.loads(aside.read_text()).get("since") != holder.get("since"):
        os.rename(aside, self.lock)  # Another run took it over first; this one is theirs.
        return
      aside.unlink()
    except (OSError, ValueError):
      pass

  def _refusal(self, holder: dict | None) -> str:
    if holder is None:
      return (f"run.output_dir {self.name} is held by another run (its lock {self.lock} cannot be read); wait for "
              "it to finish, use another run.output_dir, or delete the lock if no run uses the directory.")
    since = _when(holder.get("since", 0))
    who = f"pid {holder.get('pid')} on {holder.get('host')}"
    if holder.get("processes", 1) > 1:
      who += f" (a job of {holder['processes']} processes)"
    beat = time.time() - holder.get("beat", time.time())
    return (f"run.output_dir {self.name} is in use by another run, {who}, since {since} (lock {self.lock}, renewed "
            f"{beat:.0f}s ago); wait for it to finish or use another run.output_dir (a lock whose run is gone is "
            f"taken over: at once on the same host, after {STALE_S // 60} minutes without renewal elsewhere).")

  def _heartbeat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      try:
        if self.url:
          from etils import epath
          lock = epath.Path(self.name) / LOCK
          lock.write_text(lock.read_text())
        else:
          os.utime(self.lock)
      except OSError:
        pass  # A failing disk is reported by the save that meets it.

  # -- Files, local or URL. --

  def _read(self, p: pathlib.Path) -> str:
    if self.url:
      from etils import epath
      return (epath.Path(self.name) / p.name).read_text()
    return p.read_text()

  def _mtime(self, p: pathlib.Path) -> float:
    if self.url:
      from etils import epath
      return (epath.Path(self.name) / p.name).stat().mtime
    return p.stat().st_mtime

  def _remove(self, p: pathlib.Path) -> None:
    if self.url:
      from etils import epath
      (epath.Path(self.name) / p.name).unlink(missing_ok=True)
    else:
      p.unlink(missing_ok=True)


def _broadcast(message: str) -> str:
  """Process 0's refusal (empty if none) on every process, so that all of them stop with the same sentence."""
  from jax.experimental import multihost_utils
  raw = message.encode()[:_MESSAGE_BYTES]
  buf = np.zeros(_MESSAGE_BYTES, np.uint8)
  buf[:len(raw)] = np.frombuffer(raw, np.uint8)
  out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
  return bytes(out[out != 0].astype(np.uint8)).decode(errors="replace")
