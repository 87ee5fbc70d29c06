"""all_gather: every device all-gathers the whole K/V (with segment ids and positions) over the context axis and
attends its local queries to it. Simple and fast at modest lengths; K/V memory is O(T) per device, and with the
blockwise kernel nothing larger than a score tile is held. The backward (by autodiff) reduce-scatters dK/dV."""

from __future__ import annotations

import functools

import jax

from maxctx import sharding
from maxctx.attention import kernels
from maxctx.attention.registry import Strategy, Traffic, ids_bytes, register


@register
class AllGather(Strategy):
  name = "all_gather"

  def build(self, mesh, a):
    local = kernels.get(a.kernel, a.block_q, a.block_kv)

    def attend(q, k, v, segment_ids, positions):
      with jax.named_scope("all_gather_kv"):
        gather = functools.partial(jax.lax.all_gather, axis_name=sharding.SEQ_AXIS, axis=1, tiled=True)
        k_all, v_all, seg_all, pos_all = gather(k), gather(v), gather(segment_ids), gather(positions)
      return local(q, k_all, v_all, segment_ids, seg_all, positions, pos_all)

    return self.shard(mesh, attend)

  def traffic(self, p, rows, head_dim, dtype_bytes):
    # Forward: gather every device's K and V; backward: reduce-scatter the whole sequence's dK and dV back to their
    # owners. The ids are gathered once per step.
    g, t, kv = p.context, p.seq_len // p.context, p.n_kv_heads // p.tensor
    kv_bytes = 2 * rows * t * kv * head_dim * dtype_bytes
    return Traffic(forward={"all-gather": kv_bytes * (g - 1)}, backward={"reduce-scatter": kv_bytes * (g - 1)},
                   once={"all-gather": ids_bytes(rows, t) * (g - 1)})

  def buffer_bytes(self, p, rows, head_dim, dtype_bytes):
    # The whole sequence's K and V gathered for the forward and again for the backward, and dK, dV summed in float32
    # before the reduce-scatter (compiled: docs/results.md, the all_gather rows of "TPU estimates").
    return rows * p.seq_len * (p.n_kv_heads // p.tensor) * head_dim * (4 * dtype_bytes + 2 * 4)

  def held_kv_bytes(self, p, rows, head_dim, dtype_bytes):
    # The whole sequence's K and V (gathered) and dK, dV (before the reduce-scatter), for the device's KV heads.
    return 4 * rows * p.seq_len * (p.n_kv_heads // p.tensor) * head_dim * dtype_bytes
