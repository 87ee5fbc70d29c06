"""Deterministic synthetic documents that a small model can learn: arithmetic progressions of token ids.

Each document starts at a random token and steps by a random stride (mod the vocabulary), so after two tokens the
rest is predictable; loss falls quickly, which is what a demo and a benchmark need. Row r of batch i is a pure function
of (seed, i, r): a process makes only its own rows, resuming at step i reproduces the data exactly, and there is no
tokenizer or file to read.
"""

from __future__ import annotations

import numpy as np

from maxctx.data.packing import FIELDS


def row(seed: int, index: int, r: int, seq_len: int, vocab_size: int) -> dict[str, np.ndarray]:
  """Row r of batch `index`: packed documents, with the same fields and conventions as the packer's output."""
  rng = np.random.default_rng([seed, index, r])
  out = np.zeros((4, seq_len), np.int32)
  tokens, targets, segment_ids, positions = out
  lo, hi = max(2, seq_len // 8), max(3, seq_len // 2)
  t, seg = 0, 1
  while t < seq_len:
    n = min(int(rng.integers(lo, hi + 1)), seq_len - t)
    start, stride = rng.integers(1, vocab_size), rng.integers(1, 8)
    doc = (start + stride * np.arange(n + 1)) % (vocab_size - 1) + 1
    tokens[t:t + n], targets[t:t + n] = doc[:-1], doc[1:]
    segment_ids[t:t + n], positions[t:t + n] = seg, np.arange(n)
    t, seg = t + n, seg + 1
  return dict(zip(FIELDS, out))


def batch(seed: int, index: int, batch_size: int, seq_len: int, vocab_size: int) -> dict[str, np.ndarray]:
  rows = [row(seed, index, r, seq_len, vocab_size) for r in range(batch_size)]
  return {k: np.stack([x[k] for x in rows]) for k in FIELDS}
