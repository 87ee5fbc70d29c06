"""Deterministic synthetic documents that a small model can learn: arithmetic progressions of token ids.

Each document starts at a random token and steps by a random stride (mod the vocabulary), so after two tokens the
rest is predictable; loss falls quickly, which is what a demo and a benchmark need. Batch `i` is a pure function of
(seed, i), so resuming at step i reproduces the data exactly.
"""

from __future__ import annotations

import numpy as np


def batch(seed: int, index: int, batch_size: int, seq_len: int, vocab_size: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng([seed, index])
  tokens = np.zeros((batch_size, seq_len), np.int32)
  targets = np.zeros((batch_size, seq_len), np.int32)
  segment_ids = np.zeros((batch_size, seq_len), np.int32)
  positions = np.zeros((batch_size, seq_len), np.int32)
  lo, hi = max(2, seq_len // 8), max(3, seq_len // 2)
  for b in range(batch_size):
    t, seg = 0, 1
    while t < seq_len:
      n = min(int(rng.integers(lo, hi + 1)), seq_len - t)
      start, stride = rng.integers(1, vocab_size), rng.integers(1, 8)
      doc = (start + stride * np.arange(n + 1)) % (vocab_size - 1) + 1
      tokens[b, t:t + n], targets[b, t:t + n] = doc[:-1], doc[1:]
      segment_ids[b, t:t + n], positions[b, t:t + n] = seg, np.arange(n)
      t, seg = t + n, seg + 1
  return {"tokens": tokens, "targets": targets, "segment_ids": segment_ids, "positions": positions}
