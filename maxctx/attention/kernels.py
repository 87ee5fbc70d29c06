"""Local attention kernels: attention of the queries a device holds against the keys/values it is given.

Every kernel takes q [B, Tq, N, H], k and v [B, Tk, K, H] (N a multiple of K: grouped-query attention), the
segment ids and positions of queries and keys, and returns out [B, Tq, N, H] in q's dtype, masked by
`mask.visible`. A query that sees no key (padding) gets zeros.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from maxctx.attention import mask

Kernel = Callable[..., jax.Array]
KERNELS: dict[str, Kernel] = {}


def register(name: str):
  def wrap(fn):
    KERNELS[name] = fn
    return fn
  return wrap


@register("reference")
def reference(q_BTNH, k_BSKH, v_BSKH, q_segment_ids, kv_segment_ids, q_positions, kv_positions):
  """Dense attention in float32: the oracle the other kernels and strategies are tested against. O(Tq·Tk) memory."""
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  q_BTKGH = q_BTNH.astype(jnp.float32).reshape(B, T, K, N // K, H)
  scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH.astype(jnp.float32)) * H**-0.5
  visible_BTS = mask.visible(q_segment_ids, kv_segment_ids, q_positions, kv_positions)
  scores_BKGTS = jnp.where(visible_BTS[:, None, None], scores_BKGTS, -jnp.inf)
  row_max = jnp.max(scores_BKGTS, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs_BKGTS = jnp.exp(scores_BKGTS - row_max)
  denom = jnp.sum(probs_BKGTS, axis=-1, keepdims=True)
  probs_BKGTS = probs_BKGTS / jnp.where(denom == 0, 1.0, denom)
  out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH.astype(jnp.float32))
  return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


def get(name: str, block_q: int | None = None, block_kv: int | None = None) -> Kernel:
  """The kernel `name` with its block sizes bound (kernels without blocks ignore them)."""
  fn = KERNELS[name]
  if name == "reference":
    return fn
  return lambda *args: fn(*args, block_q=block_q, block_kv=block_kv)
