"""How the entry points log to the console: one line per record, `HH:MM:SS message`, to the standard stream named.

The handler looks the stream up when it writes (`sys.stdout` or `sys.stderr` as they are then), not when it is set
up: whoever replaced the stream since (a test's capture, a notebook) gets the line, and a stream closed since is
never written to, which a handler holding the old one would do ("I/O operation on closed file").
"""

from __future__ import annotations

import logging
import sys


class _CurrentStream(logging.StreamHandler):
  def __init__(self, name: str):
    super().__init__()
    self._name = name

  @property
  def stream(self):
    return getattr(sys, self._name)

  @stream.setter
  def stream(self, _):  # StreamHandler.__init__ sets it; the stream is always looked up instead
    pass


def setup(stream: str = "stderr", level: int = logging.INFO, prefix: str = "") -> None:
  """Replaces the root logger's handlers with one writing to `sys.<stream>` at `level`; absl (Orbax's and grain's
  per-file lines) only when it warns."""
  handler = _CurrentStream(stream)
  handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S"))
  logging.basicConfig(level=level, handlers=[handler], force=True)
  logging.getLogger("absl").setLevel(logging.WARNING)
