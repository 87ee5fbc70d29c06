"""SIGTERM (or JAX's multi-host preemption sync point) → save at the next step boundary and stop.

Until the first step is under way a run has nothing new to save, so SIGTERM keeps its default action and ends the
process at once, even in the middle of a compile that holds the interpreter for minutes (a Python handler would run
only when the compile returns). A run directory's lock left behind that way is recognised as stale by the next run
(maxctx.run_dir).

Once the first step is dispatched, with one process the signal handler only sets a flag: the loop checks it after
dispatching each step, so the save holds a whole step. With several processes JAX's preemption service owns SIGTERM
and picks a step that every host reaches (`reached_preemption_sync_point`, asked at every step by every host); a local
flag could make the hosts save at different steps and hang in the save's collectives.
"""

from __future__ import annotations

import signal
import threading

import jax
import orbax.checkpoint as ocp


class Preemption:
  """Use as a context manager around the training loop; call `started()` once the first step is dispatched."""

  def __init__(self):
    self._signalled = False
    self._previous = None
    self._own = False

  def __enter__(self) -> Preemption:
    self._own = jax.process_count() == 1 and threading.current_thread() is threading.main_thread()
    if self._own:
      self._previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return self

  def __exit__(self, *exc) -> None:
    if self._own:
      signal.signal(signal.SIGTERM, self._previous)
      self._own = False

  def started(self) -> None:
    """From now on SIGTERM asks for a save at the next step boundary."""
    if self._own:
      signal.signal(signal.SIGTERM, self._handler)

  def _handler(self, signum, frame) -> None:
    del signum, frame  # No logging here: the interrupted code may hold the logging lock.
    self._signalled = True

  def requested(self, step: int) -> bool:
    if self._signalled:
      return True
    return jax.process_count() > 1 and ocp.multihost.reached_preemption(step)
