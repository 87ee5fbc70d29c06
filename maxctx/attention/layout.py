"""Zigzag load balancing as a token layout, applied on the host by the data pipeline.

With causal attention the last tokens of a sequence see the most keys, so a plain split over P devices leaves the
last device with ~2P−1 times the work of the first. Cutting the sequence into 2P chunks and giving device i chunks i
and 2P−1−i evens it out. Every per-token array (tokens, targets, segment ids, positions) is permuted the same way;
the attention mask reads positions and segment ids, so the model needs no change and the loss (a sum over tokens)
needs no un-permuting.
"""

from __future__ import annotations

import numpy as np

from maxctx.errors import ConfigError


def row_quantum(context: int, load_balance: bool) -> int:
  """Sequence lengths must be multiples of this: the context axis cuts a row into equal parts (2 per device zigzag)."""
  return 2 * context if load_balance else context


def check_length(seq_len: int, context: int, load_balance: bool, what: str = "data.seq_len") -> None:
  """Refuses a sequence length the context axis (and the zigzag layout) cannot cut evenly."""
  q = row_quantum(context, load_balance)
  if seq_len % q:
    why = f"2 × the context degree {context} (zigzag load balancing)" if load_balance else "the context degree"
    raise ConfigError(f"{what} {seq_len} is not divisible by {q}, {why}; choose a multiple of {q}.")


def zigzag_indices(seq_len: int, context: int) -> np.ndarray:
  """Source index of each token in the zigzag layout: position t of the laid-out sequence holds token out[t]."""
  if seq_len % (2 * context):
    raise ValueError(f"seq_len {seq_len} is not divisible by 2 × context = {2 * context}")
  chunk = seq_len // (2 * context)
  order = []
  for i in range(context):
    order += [i, 2 * context - 1 - i]
  return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in order])


def zigzag(x: np.ndarray, context: int, axis: int = 1) -> np.ndarray:
  """x laid out in zigzag order along `axis` (the sequence axis)."""
  return np.take(x, zigzag_indices(x.shape[axis], context), axis=axis)


def unzigzag(x: np.ndarray, context: int, axis: int = 1) -> np.ndarray:
  """The inverse of `zigzag`."""
  return np.take(x, np.argsort(zigzag_indices(x.shape[axis], context)), axis=axis)
