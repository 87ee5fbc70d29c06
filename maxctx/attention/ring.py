"""ring: K/V chunks travel round the context axis with `ppermute` while each device attends its queries to the
chunk it holds; P hops bring every chunk past every device.

Forward: the next hop's ppermute is issued before the current chunk is computed, so XLA's async collective-permute
overlaps the transfer with the kernel. Partial results merge through the kernel's float32 online-softmax state, so
the ring never materialises more than one chunk of K/V beyond its own. A chunk pair the mask hides entirely
(`mask.hidden`: causal or document boundary, read from positions and segment ids, so it holds under zigzag) is
skipped under `lax.cond`; inside a visible pair the kernel skips hidden tiles the same way.

Backward (`jax.custom_vjp`): the forward saves only the local q, k, v, out and lse. The backward sends K/V round the
ring again, and with them float32 dK/dV accumulators: each device adds its contribution for the chunk it holds and
passes the accumulator on, so after P hops every chunk's gradient arrives home complete. Memory is O(T/P).

`ring_attention` works on any cycle of the axis, so USP reuses it across its groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxctx import sharding
from maxctx.attention import kernels, mask
from maxctx.attention.blockwise import Blockwise
from maxctx.attention.registry import Strategy, register


def ring_attention(parts: Blockwise, axis: str, perm: list[tuple[int, int]], hops: int):
  """Per-device fn(q, k, v, segment_ids, positions) -> out: the local queries attend to the K/V of all `hops`
  devices on the cycle `perm` of `axis` (each device's queries and K/V share its segment ids and positions)."""

  def send(x):
    return jax.lax.ppermute(x, axis, perm)

  def hides(seg, pos, kv_seg, kv_pos):
    q_summary = mask.summarize(seg, pos, seg.shape[1])
    return mask.hidden(q_summary, mask.summarize(kv_seg, kv_pos, kv_seg.shape[1]))[0, 0]

  def forward(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT):
    def visit(state, kv):
      k, v, kv_seg, kv_pos = kv
      return jax.lax.cond(hides(seg_BT, pos_BT, kv_seg, kv_pos), lambda s: s,
                          lambda s: parts.forward(s, q_BTNH, k, v, seg_BT, kv_seg, pos_BT, kv_pos), state)

    def hop(carry, _):
      state, kv = carry
      with jax.named_scope("ring_ppermute_kv"):
        incoming = send(kv)   # issued before the compute on `kv` so the transfer overlaps it
      return (visit(state, kv), incoming), None

    with jax.named_scope("ring_fwd"):
      kv = (k_BTKH, v_BTKH, seg_BT, pos_BT)
      state = parts.init(q_BTNH, k_BTKH.shape[2])
      (state, kv), _ = jax.lax.scan(hop, (state, kv), length=hops - 1)
      return parts.finish(visit(state, kv), q_BTNH.dtype)

  @jax.custom_vjp
  def attend(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT):
    return forward(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT)[0]

  def attend_fwd(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT):
    out_BTNH, lse = forward(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT)
    return out_BTNH, (q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT, out_BTNH, lse)

  def attend_bwd(res, dout_BTNH):
    q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT, out_BTNH, lse = res
    delta = parts.delta(out_BTNH, dout_BTNH, k_BTKH.shape[2])

    def visit(kv):
      k, v, kv_seg, kv_pos = kv
      zeros = (jnp.zeros(q_BTNH.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
      return jax.lax.cond(
          hides(seg_BT, pos_BT, kv_seg, kv_pos), lambda: zeros,
          lambda: parts.backward(q_BTNH, k, v, seg_BT, kv_seg, pos_BT, kv_pos, lse, delta, dout_BTNH))

    def hop(carry, _):
      dq, kv, dkv = carry
      with jax.named_scope("ring_ppermute_kv"):
        incoming = send(kv)
      dq_c, dk_c, dv_c = visit(kv)
      with jax.named_scope("ring_ppermute_dkv"):
        # The accumulators travel with their chunk; this hop overlaps the next chunk's compute.
        dkv = send((dkv[0] + dk_c, dkv[1] + dv_c))
      return (dq + dq_c, incoming, dkv), None

    with jax.named_scope("ring_bwd"):
      kv = (k_BTKH, v_BTKH, seg_BT, pos_BT)
      dkv = (jnp.zeros(k_BTKH.shape, jnp.float32), jnp.zeros(v_BTKH.shape, jnp.float32))
      carry = (jnp.zeros(q_BTNH.shape, jnp.float32), kv, dkv)
      (dq, kv, dkv), _ = jax.lax.scan(hop, carry, length=hops - 1)
      (dq, _, (dk, dv)), _ = hop((dq, kv, dkv), None)   # the last hop's K/V send is dead code, dropped by XLA
    return dq.astype(q_BTNH.dtype), dk.astype(k_BTKH.dtype), dv.astype(v_BTKH.dtype), None, None

  attend.defvjp(attend_fwd, attend_bwd)
  return attend


@register
class Ring(Strategy):
  name = "ring"

  def validate(self, p):
    super().validate(p)
    self.require_chunked(p, self.name)

  def build(self, mesh, *, kernel, load_balance, ulysses_degree, block_q, block_kv):
    hops = mesh.shape[sharding.SEQ_AXIS]
    perm = [(i, (i + 1) % hops) for i in range(hops)]
    return self.shard(mesh, ring_attention(kernels.parts(kernel, block_q, block_kv), sharding.SEQ_AXIS, perm, hops))
