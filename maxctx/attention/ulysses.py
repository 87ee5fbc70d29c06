"""ulysses (DeepSpeed-Ulysses): an all-to-all turns sequence-sharded q, k, v into head-sharded ones, each device
attends its heads over the whole sequence, and a second all-to-all turns the output back. K/V memory is O(T/P)
per device for the all-to-all buffers, O(T·K/P) for the attention itself.

GQA with fewer KV heads than the all-to-all degree: each KV head is repeated r = degree / gcd(K, degree) times
(jnp.repeat keeps the copies of a head adjacent, so query head n still meets a copy of KV head n // G after the
split) — the least replication that lets the degree split the KV heads. MaxText refuses this case; we don't.
Autodiff sums the copies' gradients back. Query heads must still split evenly: N / tensor divisible by the degree.

The all-to-all helpers take `axis_index_groups`, so USP reuses them inside groups of adjacent devices.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from maxctx import sharding
from maxctx.attention import kernels
from maxctx.attention.registry import Strategy, register
from maxctx.errors import ConfigError


def kv_replication(kv_heads: int, degree: int) -> int:
  """How many copies of each KV head make `kv_heads` divisible by the all-to-all `degree`."""
  return degree // math.gcd(kv_heads, degree)


def heads_first(axis: str, groups: list[list[int]] | None, degree: int, inner):
  """Per-device fn(q, k, v, segment_ids, positions): all-to-all to head sharding within `groups` of `axis`, then
  `inner(q, k, v, segment_ids, positions)` over the group's whole sequence, then all-to-all back."""
  to_heads = functools.partial(jax.lax.all_to_all, axis_name=axis, split_axis=2, concat_axis=1, tiled=True,
                               axis_index_groups=groups)
  to_tokens = functools.partial(jax.lax.all_to_all, axis_name=axis, split_axis=1, concat_axis=2, tiled=True,
                                axis_index_groups=groups)
  gather = functools.partial(jax.lax.all_gather, axis_name=axis, axis=1, tiled=True, axis_index_groups=groups)

  def attend(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT):
    copies = kv_replication(k_BTKH.shape[2], degree)
    if copies > 1:
      with jax.named_scope("ulysses_replicate_kv"):
        k_BTKH, v_BTKH = jnp.repeat(k_BTKH, copies, axis=2), jnp.repeat(v_BTKH, copies, axis=2)
    with jax.named_scope("ulysses_all_to_all_in"):
      q_BTNH, k_BTKH, v_BTKH = to_heads(q_BTNH), to_heads(k_BTKH), to_heads(v_BTKH)
      # Segment ids and positions have no head axis: every device of the group needs them all (all-gather).
      seg_BT, pos_BT = gather(seg_BT), gather(pos_BT)
    out_BTNH = inner(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT)
    with jax.named_scope("ulysses_all_to_all_out"):
      return to_tokens(out_BTNH)

  return attend


def check_heads(p, degree: int, name: str, fix: str) -> None:
  local = p.n_heads // p.tensor
  if local % degree:
    raise ConfigError(f"attention.strategy {name} splits the {local} query heads per tensor shard over an "
                      f"all-to-all degree of {degree}, which does not divide them; {fix}")


@register
class Ulysses(Strategy):
  name = "ulysses"

  def validate(self, p):
    super().validate(p)
    check_heads(p, p.context, self.name, "use ring, or usp with an attention.ulysses_degree that divides them.")

  def build(self, mesh, *, kernel, load_balance, ulysses_degree, block_q, block_kv):
    local = kernels.get(kernel, block_q, block_kv)
    degree = mesh.shape[sharding.SEQ_AXIS]
    inner = lambda q, k, v, seg, pos: local(q, k, v, seg, seg, pos, pos)  # noqa: E731
    return self.shard(mesh, heads_first(sharding.SEQ_AXIS, None, degree, inner))
