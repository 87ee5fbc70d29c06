"""Training rows of generated passkey examples, for the passkey demo (configs/demo-passkey.yml).

A row is the passkey example the eval scores at the training length: exactly seq_len tokens (prompt + answer, built
by maxctx.data.tasks at a uniformly random depth), so its seq_len − 1 (token, target) pairs fill the row and its last
slot is padding. Built at any other length, every answer would sit one or more positions away from where the eval
asks for it, and a small model, which learns where to look as much as what to look for, then scores nothing.

Row r of batch i is a pure function of (seed, i, r) like maxctx.data.synthetic's rows, so a process makes only its rows
and resuming reproduces the data. Training examples use seeds the evaluation never uses (`TRAIN_SALT`), so the demo's
accuracy is measured on passkeys the model has not seen.
"""

from __future__ import annotations

import numpy as np

from maxctx.data.packing import FIELDS
from maxctx.data import tasks

TRAIN_SALT = 1 << 30


def row(pieces: tasks.Pieces, seed: int, index: int, r: int, seq_len: int) -> dict[str, np.ndarray]:
  """Row r of batch `index`: {tokens, targets, segment_ids, positions}, int32 [seq_len]."""
  rng = np.random.default_rng([seed, index, r, TRAIN_SALT])
  depth = float(rng.random())
  e = tasks.generate("passkey", pieces, seq_len, depth, int(rng.integers(1 << 31)), seed + TRAIN_SALT)
  doc = np.concatenate([e.prompt, e.answer]).astype(np.int32)
  pad = np.zeros(1, np.int32)
  real = np.ones(seq_len - 1, np.int32)
  return dict(zip(FIELDS, (np.concatenate([doc[:-1], pad]), np.concatenate([doc[1:], pad]),
                           np.concatenate([real, pad]), np.concatenate([np.arange(seq_len - 1, dtype=np.int32), pad]))))

