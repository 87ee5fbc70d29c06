"""Runs a maxctx entry point with a fault the tests cannot cause otherwise (they run as root, on one disk):

    python tests/faults/inject.py FAULT[,FAULT...] maxctx.train CONFIG.yml key=value ...

  unwritable@N   from the save of step N on, creating anything under <run.output_dir>/checkpoints fails with EACCES,
                 as when the directory's permissions change (root ignores chmod)
  full@N         from the save of step N on, writing a file under <run.output_dir>/checkpoints fails with ENOSPC
  sync-step=S    each train step returns only when it has finished, S seconds later (a backend that dispatches
                 synchronously): the host reads every step's metrics after the step that follows it has run
  no-libtpu      jax finds no TPU support, as in an environment without libtpu
  stdlib=DIR     the standard library is DIR (the demo corpus of another Python installation)
"""

import errno
import os
import runpy
import sys
import time


def _under_checkpoints(path) -> bool:
  return isinstance(path, (str, bytes, os.PathLike)) and "/checkpoints/" in os.fsdecode(os.fspath(path))


def _fail_from_step(step: int, err: int, what: str) -> None:
  from maxctx import checkpoint
  save = checkpoint.Checkpoints.save

  def failing_save(self, n, *args, **kwargs):
    if n >= step:
      self.wait()  # The saves before step N are complete: the fault starts between two saves.
      _break_writes(err, what)
    return save(self, n, *args, **kwargs)

  checkpoint.Checkpoints.save = failing_save


def _break_writes(err: int, what: str) -> None:
  real_mkdir, real_open = os.mkdir, os.open

  def mkdir(path, *args, **kwargs):
    if what == "mkdir" and _under_checkpoints(path):
      raise OSError(err, os.strerror(err), os.fspath(path))
    return real_mkdir(path, *args, **kwargs)

  def open_(path, flags, *args, **kwargs):
    if _under_checkpoints(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
      raise OSError(err, os.strerror(err), os.fspath(path))
    return real_open(path, flags, *args, **kwargs)

  os.mkdir = mkdir
  os.open = open_
  import builtins
  real_builtin_open = builtins.open

  def builtin_open(file, mode="r", *args, **kwargs):
    if _under_checkpoints(file) and any(c in mode for c in "wax+"):
      raise OSError(err, os.strerror(err), os.fspath(file))
    return real_builtin_open(file, mode, *args, **kwargs)

  builtins.open = builtin_open


def _sync_step(seconds: float) -> None:
  import jax
  from maxctx import trainer

  post_init = trainer.Trainer.__post_init__

  def patched(self):
    post_init(self)
    step = self.step

    def sync(*args):
      out = jax.block_until_ready(step(*args))
      time.sleep(seconds)
      return out

    self.step = sync

  trainer.Trainer.__post_init__ = patched


def _no_libtpu() -> None:
  from jax._src import xla_bridge
  xla_bridge.get_tpu_library_path = lambda: None


def _stdlib(directory: str) -> None:
  import sysconfig
  get_paths = sysconfig.get_paths
  sysconfig.get_paths = lambda *a, **k: {**get_paths(*a, **k), "stdlib": directory}


def main() -> None:
  faults, module, *args = sys.argv[1:]
  for fault in faults.split(","):
    name, _, value = fault.partition("@") if "@" in fault else fault.partition("=")
    if name == "unwritable":
      _fail_from_step(int(value), errno.EACCES, "mkdir")
    elif name == "full":
      _fail_from_step(int(value), errno.ENOSPC, "write")
    elif name == "sync-step":
      _sync_step(float(value))
    elif name == "no-libtpu":
      _no_libtpu()
    elif name == "stdlib":
      _stdlib(value)
    else:
      raise SystemExit(f"unknown fault {fault!r}")
  sys.argv = [module, *args]
  runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main()
