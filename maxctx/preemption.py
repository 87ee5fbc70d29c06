"""SIGTERM (or JAX's multi-host preemption sync point) → save at the next step boundary and stop.

Until the first step is under way a run has nothing new to save, so SIGTERM ends the process at once (exit code 143,
as a process killed by SIGTERM), even in the middle of a compile that holds the main thread for minutes, and first
undoes what the run wrote (`before_start`: config.yml, TensorBoard files, the directory's lock; maxctx.run_dir). A
Python handler runs only when the main thread returns to Python, so a watcher thread hears the signal instead,
through the interpreter's wakeup fd, and acts at once: the compile releases the GIL.

Once the first step is dispatched, with one process the signal handler only sets a flag: the loop checks it after
dispatching each step, so the save holds a whole step. With several processes JAX's preemption service owns SIGTERM
and picks a step that every host reaches (`reached_preemption_sync_point`, asked at every step by every host); a local
flag could make the hosts save at different steps and hang in the save's collectives.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from typing import Callable

import jax
import orbax.checkpoint as ocp

EXIT_CODE = 128 + signal.SIGTERM
_QUIT = b"\0"  # No signal has number 0: it tells the watcher to stop.


class Preemption:
  """Use as a context manager around the training loop; call `started()` once the first step is dispatched."""

  def __init__(self):
    self._signalled = False
    self._started = False
    self._previous = None
    self._own = False
    self._undo: list[Callable[[], None]] = []
    self._ending = threading.Lock()
    self._wake: tuple[socket.socket, socket.socket] | None = None
    self._previous_fd = -1

  def __enter__(self) -> Preemption:
    self._own = jax.process_count() == 1 and threading.current_thread() is threading.main_thread()
    if self._own:
      self._previous = signal.signal(signal.SIGTERM, self._end_now)
      self._wake = socket.socketpair()
      self._wake[1].setblocking(False)
      self._previous_fd = signal.set_wakeup_fd(self._wake[1].fileno(), warn_on_full_buffer=False)
      threading.Thread(target=self._watch, name="maxctx-sigterm-watcher", daemon=True).start()
    return self

  def __exit__(self, *exc) -> None:
    if self._own:
      signal.signal(signal.SIGTERM, self._previous)
      self._stop_watching()
      self._own = False

  def before_start(self, undo: Callable[[], None]) -> None:
    """`undo` runs if SIGTERM ends the run before its first step (from another thread; the process ends after)."""
    self._undo.append(undo)

  def started(self) -> None:
    """From now on SIGTERM asks for a save at the next step boundary."""
    if self._own:
      self._started = True
      signal.signal(signal.SIGTERM, self._handler)
      self._stop_watching()

  def _handler(self, signum, frame) -> None:
    del signum, frame  # No logging here: the interrupted code may hold the logging lock.
    self._signalled = True

  def _end_now(self, signum=None, frame=None) -> None:
    """SIGTERM before the first step: undo what the run wrote and end the process."""
    del signum, frame
    if self._started:  # The signal came as the first step started: the loop saves it.
      self._signalled = True
      return
    self._ending.acquire()  # Whichever thread comes second waits here until the process ends.
    for undo in self._undo:
      try:
        undo()
      except Exception:  # noqa: BLE001 — ending anyway; what is left is recognised by the next run.
        pass
    os.write(1, b"stopped by SIGTERM before the first step: nothing to save; what the run wrote is removed.\n")
    os._exit(EXIT_CODE)

  def _watch(self) -> None:
    read = self._wake[0]
    with read:
      self._watch_on(read)

  def _watch_on(self, read: socket.socket) -> None:
    while True:
      try:
        data = read.recv(64)
      except OSError:
        return
      if self._previous_fd >= 0:  # Whoever set the wakeup fd before still hears of every signal.
        try:
          os.write(self._previous_fd, data.replace(_QUIT, b""))
        except OSError:
          pass
      if not data or _QUIT in data:
        return
      if signal.SIGTERM in data and not self._started:
        self._end_now()

  def _stop_watching(self) -> None:
    if self._wake is None:
      return
    signal.set_wakeup_fd(self._previous_fd)
    read, write = self._wake
    self._wake = None
    try:
      write.setblocking(True)
      write.send(_QUIT)
    finally:
      write.close()

  def requested(self, step: int) -> bool:
    if self._signalled:
      return True
    return jax.process_count() > 1 and ocp.multihost.reached_preemption(step)
