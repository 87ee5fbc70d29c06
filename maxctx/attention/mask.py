"""The one mask every strategy honours: query i sees key j iff they share a non-zero segment and j is not later.

    visible(i, j) = segment_ids[i] == segment_ids[j] != 0  and  positions[j] <= positions[i]

It reads only per-token ids and positions, so it is exact under any permutation of tokens (zigzag load balancing
needs no model change) and covers causal attention and packed documents at once.

Skipping work: a block of queries and a block of keys are summarised by the lexicographic extremes of their
(segment, position) keys. If query i sees key j then (seg, pos_j) ≤ (seg, pos_i), so the smallest key of the key
block is ≤ the largest key of the query block. When it is not, or the segment ranges are disjoint, or either block is
all padding, nothing in the pair is visible and the kernels and the ring skip it. The test reads positions and
segment ids, never device indices, so it skips correctly under zigzag and for document boundaries.
"""

from __future__ import annotations

import jax.numpy as jnp

_BIG = jnp.iinfo(jnp.int32).max


def visible(q_segment_ids, kv_segment_ids, q_positions, kv_positions):
  """Boolean [B, Tq, Tk]."""
  same_doc = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]) & (q_segment_ids[:, :, None] != 0)
  return same_doc & (kv_positions[:, None, :] <= q_positions[:, :, None])


def summarize(segment_ids_BT, positions_BT, block: int):
  """Per block of `block` tokens and per row: (lowest segment, its lowest position, highest segment, its highest
  position) over the non-padding tokens, and whether the block has padding, each [B, T // block]. An all-padding
  block gets lowest = INT32_MAX, highest 0."""
  B, T = segment_ids_BT.shape
  seg = segment_ids_BT.reshape(B, T // block, block).astype(jnp.int32)
  pos = positions_BT.reshape(B, T // block, block).astype(jnp.int32)
  real = seg != 0
  lo_seg = jnp.min(jnp.where(real, seg, _BIG), axis=-1)
  lo_pos = jnp.min(jnp.where(real & (seg == lo_seg[..., None]), pos, _BIG), axis=-1)
  hi_seg = jnp.max(jnp.where(real, seg, 0), axis=-1)
  hi_pos = jnp.max(jnp.where(real & (seg == hi_seg[..., None]), pos, -1), axis=-1)
  return lo_seg, lo_pos, hi_seg, hi_pos, ~jnp.all(real, axis=-1)


def pair_hidden(q_summary, kv_summary):
  """Whether no query of a block with `q_summary` sees any key of a block with `kv_summary`, elementwise: the
  summaries' fields may be arrays that broadcast or scalars (the Pallas kernels test one tile pair at a time)."""
  q_lo_seg, _, q_hi_seg, q_hi_pos, _ = q_summary
  kv_lo_seg, kv_lo_pos, kv_hi_seg, _, _ = kv_summary
  empty = (q_hi_seg == 0) | (kv_lo_seg == _BIG)
  disjoint = (q_hi_seg < kv_lo_seg) | (kv_hi_seg < q_lo_seg)
  later = (kv_lo_seg == q_hi_seg) & (kv_lo_pos > q_hi_pos)
  return empty | disjoint | later


def pair_full(q_summary, kv_summary):
  """Whether every query of the block sees every key of the other, elementwise as `pair_hidden`: one document on
  both sides, no padding, and the key block's last position not after the query block's first. Such tiles need no
  mask at all. The padding flags must be booleans."""
  q_lo_seg, q_lo_pos, q_hi_seg, _, q_pad = q_summary
  kv_lo_seg, _, kv_hi_seg, kv_hi_pos, kv_pad = kv_summary
  one_doc = (q_lo_seg == q_hi_seg) & (kv_lo_seg == kv_hi_seg) & (q_lo_seg == kv_lo_seg)
  return one_doc & ~q_pad & ~kv_pad & (kv_hi_pos <= q_lo_pos)


def hidden(q_summary, kv_summary):
  """Boolean [nq, nk]: True where no query of block i sees any key of block j, in every row of the batch."""
  return jnp.all(pair_hidden([x[:, :, None] for x in q_summary], [x[:, None, :] for x in kv_summary]), axis=0)


def full(q_summary, kv_summary):
  """Boolean [nq, nk]: True where every query of block i sees every key of block j, in every row (`pair_full`)."""
  return jnp.all(pair_full([x[:, :, None] for x in q_summary], [x[:, None, :] for x in kv_summary]), axis=0)
