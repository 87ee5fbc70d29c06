"""Training rows of generated passkey examples, for the passkey demo (configs/demo-passkey.yml).

A row is one passkey example of exactly seq_len + 1 tokens (seq_len (token, target) pairs, no padding) with the needle
at a uniformly random depth, or, for a fraction `COPY_FRACTION` of rows, a copy drill: a random run of tokens said
twice. Retrieval needs induction heads (find the earlier occurrence of the current context, copy what followed), and a
passkey example has only ~10 tokens whose loss rewards them; the drills reward them on half their tokens, so a tiny
model forms them in minutes instead of hours, and the passkey rows then teach it what to look up. Row r of batch i is a
pure function of (seed, i, r) like maxctx.data.synthetic's rows, so a process makes only its rows and resuming
reproduces the data. Training examples use seeds the evaluation never uses (`TRAIN_SALT`), so the demo's accuracy is
measured on passkeys the model has not seen.
"""

from __future__ import annotations

import numpy as np

from maxctx.data.packing import FIELDS
from maxctx.eval import tasks

TRAIN_SALT = 1 << 30
COPY_FRACTION = 0.5


def row(pieces: tasks.Pieces, seed: int, index: int, r: int, seq_len: int) -> dict[str, np.ndarray]:
  """Row r of batch `index`: {tokens, targets, segment_ids, positions}, int32 [seq_len]."""
  rng = np.random.default_rng([seed, index, r, TRAIN_SALT])
  if rng.random() < COPY_FRACTION:
    doc = _copy_drill(rng, pieces, seq_len + 1)
  else:
    depth = float(rng.random())
    e = tasks.generate("passkey", pieces, seq_len + 1, depth, int(rng.integers(1 << 31)), seed + TRAIN_SALT)
    doc = np.concatenate([e.prompt, e.answer])
  return dict(zip(FIELDS, (doc[:-1], doc[1:], np.ones(seq_len, np.int32), np.arange(seq_len, dtype=np.int32))))


def batch(pieces: tasks.Pieces, seed: int, index: int, rows: list[int], seq_len: int) -> dict[str, np.ndarray]:
  """The given rows of batch `index`, stacked: {field: int32 [len(rows), seq_len]}."""
  out = [row(pieces, seed, index, r, seq_len) for r in rows]
  return {k: np.stack([x[k] for x in out]) for k in FIELDS}


def _copy_drill(rng: np.random.Generator, pieces: tasks.Pieces, n: int) -> np.ndarray:
  """[BOS] run run ... cut to n tokens; the run's tokens are ordinary ones (no BOS/EOS), its length random."""
  tok = pieces.tokenizer
  special = {i for i in (tok.bos_id, tok.eos_id) if i is not None}
  ordinary = np.array([i for i in range(tok.vocab_size) if i not in special], np.int32)
  run = rng.choice(ordinary, int(rng.integers(8, max(9, n // 2))))
  body = np.tile(run, n // len(run) + 1)
  return np.concatenate([np.asarray(pieces.bos, np.int32), body])[:n].astype(np.int32)
