"""Training rows of a generated task's examples (`data.source: task`, `data.task`; `data.source: passkey` is the
passkey task): the extension demo (configs/demo-extend.yml) and the passkey demo train on them.

A row is the example the eval scores at the training length: exactly seq_len tokens (prompt + answer, built by
maxctx.data.tasks with the needle at a uniformly random depth), so its seq_len − 1 (token, target) pairs fill the row
and its last slot is padding. Built at any other length, every answer would sit one or more positions away from where
the eval asks for it, and a small model, which learns where to look as much as what to look for, then scores nothing.
With `data.task_min_len` a row instead packs several such examples, of lengths drawn log-uniformly from that minimum up
(the last one takes the rest), each its own document with positions from 0, so short examples, where the needle is
near the question, teach retrieval before long ones need it (the extension demo learned none without them).

Row r of batch i is a pure function of (seed, i, r) like maxctx.data.synthetic's rows, so a process makes only its rows
and resuming reproduces the data; a stage that changes data.seq_len makes rows at its own length from the next batch
on. Training examples use seeds the evaluation never uses (`TRAIN_SALT`), so a demo's accuracy is measured on
examples the model has not seen.
"""

from __future__ import annotations

import numpy as np

from maxctx.data.packing import FIELDS
from maxctx.data import tasks

TRAIN_SALT = 1 << 30


def row(task: str, pieces: tasks.Pieces, seed: int, index: int, r: int, seq_len: int,
        min_len: int = 0) -> dict[str, np.ndarray]:
  """Row r of batch `index`: {tokens, targets, segment_ids, positions}, int32 [seq_len]. With `min_len`, the row
  packs examples of random lengths in [min_len, seq_len] (each its own document) instead of one of seq_len."""
  rng = np.random.default_rng([seed, index, r, TRAIN_SALT])
  lengths, room = [], seq_len
  while room:
    n = room if not min_len or room < 2 * min_len else int(np.exp(rng.uniform(np.log(min_len), np.log(room + 1))))
    n = room if room - n < min_len else n
    lengths.append(n)
    room -= n
  parts = {k: [] for k in FIELDS}
  for s, n in enumerate(lengths, 1):
    e = tasks.generate(task, pieces, n, float(rng.random()), int(rng.integers(1 << 31)), seed + TRAIN_SALT)
    doc = np.concatenate([e.prompt, e.answer]).astype(np.int32)
    parts["tokens"].append(doc[:-1])
    parts["targets"].append(doc[1:])
    parts["segment_ids"].append(np.full(n - 1, s, np.int32))
    parts["positions"].append(np.arange(n - 1, dtype=np.int32))
  pad = np.zeros(len(lengths), np.int32)
  return {k: np.concatenate([*v, pad]).astype(np.int32) for k, v in parts.items()}
