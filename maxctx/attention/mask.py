"""The one mask every strategy honours: query i sees key j iff they share a non-zero segment and j is not later.

    visible(i, j) = segment_ids[i] == segment_ids[j] != 0  and  positions[j] <= positions[i]

It reads only per-token ids and positions, so it is exact under any permutation of tokens (zigzag load balancing
needs no model change) and covers causal attention and packed documents at once.
"""

import jax.numpy as jnp


def visible(q_segment_ids, kv_segment_ids, q_positions, kv_positions):
  """Boolean [B, Tq, Tk]."""
  same_doc = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]) & (q_segment_ids[:, :, None] != 0)
  return same_doc & (kv_positions[:, None, :] <= q_positions[:, :, None])
