"""ulysses (DeepSpeed-Ulysses): an all-to-all turns sequence-sharded q, k, v into head-sharded ones, each device
attends its heads over the whole sequence, and a second all-to-all turns the output back. K/V memory is O(T/P)
per device for the all-to-all buffers, O(T·K/P) for the attention itself.

GQA with fewer KV heads than the all-to-all degree: each KV head is repeated r = degree / gcd(K, degree) times
(jnp.repeat keeps the copies of a head adjacent, so query head n still meets a copy of KV head n // G after the
split) — the least replication that lets the degree split the KV heads, so such a degree runs instead of being
refused. Autodiff sums the copies' gradients back. Query heads must still split evenly: N / tensor divisible by the
degree.

`AllToAll` takes `axis_index_groups`, so USP reuses it inside groups of adjacent devices.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from maxctx import sharding
from maxctx.attention import kernels
from maxctx.attention.registry import Strategy, Traffic, ids_bytes, register
from maxctx.errors import ConfigError


def kv_replication(kv_heads: int, degree: int) -> int:
  """How many copies of each KV head make `kv_heads` divisible by the all-to-all `degree`."""
  return degree // math.gcd(kv_heads, degree)


@dataclasses.dataclass(frozen=True)
class AllToAll:
  """The all-to-alls of one Ulysses group layout: `groups` of `degree` devices on `axis` (None: the whole axis)."""
  axis: str
  groups: list[list[int]] | None
  degree: int

  def _each(self, fn, xs):
    out = tuple(fn(x) for x in xs)
    return out if len(out) > 1 else out[0]

  def to_heads(self, *xs_BTNH):
    """Token-sharded [B, T/P, N, H] → head-sharded [B, T·U/P, N/U, H] (all-to-all)."""
    with jax.named_scope("ulysses_all_to_all_in"):
      return self._each(lambda x: jax.lax.all_to_all(x, self.axis, 2, 1, tiled=True, axis_index_groups=self.groups),
                        xs_BTNH)

  def to_tokens(self, *xs_BTNH):
    """The inverse of `to_heads` (all-to-all)."""
    with jax.named_scope("ulysses_all_to_all_out"):
      return self._each(lambda x: jax.lax.all_to_all(x, self.axis, 1, 2, tiled=True, axis_index_groups=self.groups),
                        xs_BTNH)

  def gather(self, xs_BT):
    """Per-token arrays with no head axis (segment ids, positions): every group member needs all (all-gather)."""
    return tuple(jax.lax.all_gather(x, self.axis, axis=1, tiled=True, axis_index_groups=self.groups) for x in xs_BT)

  def replicate(self, k_BTKH, v_BTKH):
    copies = kv_replication(k_BTKH.shape[2], self.degree)
    if copies == 1:
      return k_BTKH, v_BTKH
    with jax.named_scope("ulysses_replicate_kv"):
      return jnp.repeat(k_BTKH, copies, axis=2), jnp.repeat(v_BTKH, copies, axis=2)

  def unreplicate(self, dk_BTKH, dv_BTKH, kv_heads):
    """The transpose of `replicate`: each KV head's gradient is the sum over its copies."""
    B, T, KC, H = dk_BTKH.shape
    return tuple(x.reshape(B, T, kv_heads, KC // kv_heads, H).sum(axis=3) for x in (dk_BTKH, dv_BTKH))


def heads_first(all_to_all: AllToAll, inner):
  """Per-device fn(q, k, v, segment_ids, positions): all-to-all to head sharding, `inner(q, k, v, segment_ids,
  positions)` over the group's whole sequence, all-to-all back. Autodiff transposes the all-to-alls."""

  def attend(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT):
    q_BTNH, k_BTKH, v_BTKH = all_to_all.to_heads(q_BTNH, *all_to_all.replicate(k_BTKH, v_BTKH))
    seg_BT, pos_BT = all_to_all.gather((seg_BT, pos_BT))
    return all_to_all.to_tokens(inner(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT))

  return attend


def check_heads(p, degree: int, name: str, fix: str) -> None:
  local = p.n_heads // p.tensor
  if local % degree:
    raise ConfigError(f"attention.strategy {name} splits the {local} query heads per tensor shard over an "
                      f"all-to-all degree of {degree}, which does not divide them; {fix}")


def relayout_bytes(p, rows: int, head_dim: int, dtype_bytes: int) -> float:
  """q, k, v and the output once more in the all-to-all's other layout (all tokens of a share of the heads: the same
  bytes as the device's own tokens of all of them)."""
  return rows * p.seq_len // p.context * (2 * p.n_heads + 2 * p.n_kv_heads) // p.tensor * head_dim * dtype_bytes


@register
class Ulysses(Strategy):
  name = "ulysses"

  def validate(self, p):
    super().validate(p)
    check_heads(p, p.context, self.name, "use ring, or usp with an attention.ulysses_degree that divides them.")

  def buffer_bytes(self, p, rows, head_dim, dtype_bytes):
    return relayout_bytes(p, rows, head_dim, dtype_bytes)

  def traffic(self, p, rows, head_dim, dtype_bytes):
    # Forward: q and the (copied) K, V to head sharding, the output back; backward: the output's cotangent to heads,
    # dq, dK, dV back, all in the compute dtype. The ids are gathered once per step.
    g, t = p.context, p.seq_len // p.context
    head = rows * t * head_dim * dtype_bytes   # bytes of one head over the device's tokens
    kv_local = p.n_kv_heads // p.tensor
    q, kv = p.n_heads // p.tensor * head, kv_local * kv_replication(kv_local, g) * head
    a2a = (2 * q + 2 * kv) * (g - 1) / g
    return Traffic(forward={"all-to-all": a2a}, backward={"all-to-all": a2a},
                   once={"all-gather": ids_bytes(rows, t) * (g - 1)})

  def build(self, mesh, a):
    local = kernels.get(a.kernel, a.block_q, a.block_kv)
    degree = mesh.shape[sharding.SEQ_AXIS]
    inner = lambda q, k, v, seg, pos: local(q, k, v, seg, seg, pos, pos)  # noqa: E731
    return self.shard(mesh, heads_first(AllToAll(sharding.SEQ_AXIS, None, degree), inner))
