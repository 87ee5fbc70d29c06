"""ring: K/V chunks travel round the context axis with `ppermute` while each device attends its queries to the
chunk it holds; P hops bring every chunk past every device.

Forward: the next hop's ppermute is issued before the current chunk is computed, so XLA's async collective-permute
overlaps the transfer with the kernel. Partial results merge through the kernel's float32 online-softmax state
(running max and denominator), so the ring never holds more than the chunk it computes on and the one arriving.
A chunk pair the mask hides entirely (causal or document boundary, read from positions and segment ids by
`mask.hidden`, so it holds under zigzag) is skipped: the kernel runs zero trips over it; inside a visible pair the
kernel skips hidden tiles the same way.

Backward (`jax.custom_vjp`): the forward saves only the local q, k, v, out and lse. The backward sends K/V round the
ring again, and with them float32 dK/dV accumulators: each device adds its contribution for the chunk it holds and
passes the accumulator on, so after P hops every chunk's gradient arrives home complete.

Memory: the buffers in flight (K/V arriving, dK/dV leaving) and the kernel's score tiles would not shrink with P if
all heads travelled at once, so the ring runs one pass per KV head (with its query heads; USP needs at least U
query heads per pass): in-flight memory is that head's, and everything else is O(T/P).

`ring_attention` works on any cycle of the axis, so USP reuses it across its groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxctx import sharding
from maxctx.attention import kernels
from maxctx.attention.blockwise import Blockwise
from maxctx.attention.registry import Strategy, register
from maxctx.attention.ulysses import AllToAll

# One KV head (with its query heads) per pass: in-flight buffers and score tiles are one head's, which also keeps a
# tile in cache (on the CPU, passes of all 8 heads ran 1.5× slower than 8 passes of one).
KV_HEADS_PER_PASS = 1


def _heads(x, start, size):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=2)


def ring_attention(parts: Blockwise, axis: str, perm: list[tuple[int, int]], hops: int,
                   all_to_all: AllToAll | None = None, kv_heads_per_pass: int = KV_HEADS_PER_PASS):
  """Per-device fn(q, k, v, segment_ids, positions) -> out: the local queries attend to the K/V of all `hops`
  devices on the cycle `perm` of `axis` (each device's queries and K/V share its segment ids and positions).

  With `all_to_all` (USP), each pass first moves its heads from token to head sharding inside the all-to-all
  groups, runs the ring over the groups, and moves the output back; the backward does the same with the gradients.
  """
  degree = all_to_all.degree if all_to_all else 1

  def send(x):
    return jax.lax.ppermute(x, axis, perm)

  # K with V, and segment ids with positions, travel stacked: one collective-permute each per hop instead of two.
  def ring_forward(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT):
    def visit(state, kv_2BTKH, ids_2BT):
      return parts.forward(state, q_BTNH, kv_2BTKH[0], kv_2BTKH[1], seg_BT, ids_2BT[0], pos_BT, ids_2BT[1])

    def hop(carry, _):
      state, kv_2BTKH, ids_2BT = carry
      with jax.named_scope("ring_ppermute_kv"):
        incoming = send((kv_2BTKH, ids_2BT))   # issued before the compute on this chunk so the transfer overlaps it
      return (visit(state, kv_2BTKH, ids_2BT), *incoming), None

    carry = (parts.init(q_BTNH, k_BTKH.shape[2]), jnp.stack([k_BTKH, v_BTKH]), jnp.stack([seg_BT, pos_BT]))
    (state, kv_2BTKH, ids_2BT), _ = jax.lax.scan(hop, carry, length=hops - 1)
    return parts.finish(visit(state, kv_2BTKH, ids_2BT), q_BTNH.dtype)

  def ring_backward(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT, lse, delta, dout_BTNH):
    def hop(carry, _):
      dq, kv_2BTKH, ids_2BT, dkv_2BTKH = carry
      with jax.named_scope("ring_ppermute_kv"):
        incoming = send((kv_2BTKH, ids_2BT))
      dq, dk, dv = parts.backward(q_BTNH, kv_2BTKH[0], kv_2BTKH[1], seg_BT, ids_2BT[0], pos_BT, ids_2BT[1], lse,
                                  delta, dout_BTNH, grads=(dq, dkv_2BTKH[0], dkv_2BTKH[1]))
      with jax.named_scope("ring_ppermute_dkv"):
        # The accumulators travel with their chunk; this hop overlaps the next chunk's compute.
        dkv_2BTKH = send(jnp.stack([dk, dv]))
      return (dq, *incoming, dkv_2BTKH), None

    carry = (jnp.zeros(q_BTNH.shape, jnp.float32), jnp.stack([k_BTKH, v_BTKH]), jnp.stack([seg_BT, pos_BT]),
             jnp.zeros((2, *k_BTKH.shape), jnp.float32))
    carry, _ = jax.lax.scan(hop, carry, length=hops - 1)
    (dq, _, _, dkv_2BTKH), _ = hop(carry, None)   # the last hop's K/V send is dead code, dropped by XLA
    return dq, dkv_2BTKH[0], dkv_2BTKH[1]

  def plan(q_BTNH, k_BTKH):
    """(passes, KV heads per pass, query heads per KV head): the fewest KV heads per pass, at least
    `kv_heads_per_pass`, whose query heads the all-to-all degree splits."""
    N, K = q_BTNH.shape[2], k_BTKH.shape[2]
    G = N // K
    per = next(d for d in range(1, K + 1) if K % d == 0 and d * G % degree == 0 and d >= min(kv_heads_per_pass, K))
    return K // per, per, G

  def forward(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT):
    n, per, G = plan(q_BTNH, k_BTKH)
    ring_seg, ring_pos = (seg_BT, pos_BT) if all_to_all is None else all_to_all.gather((seg_BT, pos_BT))

    def one(i, carry):
      out_BTNH, lse_all = carry
      q, k, v = _heads(q_BTNH, i * per * G, per * G), _heads(k_BTKH, i * per, per), _heads(v_BTKH, i * per, per)
      if all_to_all is not None:
        q, k, v = all_to_all.to_heads(q, *all_to_all.replicate(k, v))
      out, lse = ring_forward(q, k, v, ring_seg, ring_pos)
      if all_to_all is not None:
        out = all_to_all.to_tokens(out)
      return (jax.lax.dynamic_update_slice_in_dim(out_BTNH, out, i * per * G, axis=2),
              jax.lax.dynamic_update_index_in_dim(lse_all, lse, i, axis=0))

    q0, k0, v0 = _heads(q_BTNH, 0, per * G), _heads(k_BTKH, 0, per), _heads(v_BTKH, 0, per)
    if all_to_all is not None:
      q0, k0, v0 = jax.eval_shape(lambda q, k, v: all_to_all.to_heads(q, *all_to_all.replicate(k, v)), q0, k0, v0)
    lse0 = jax.eval_shape(ring_forward, q0, k0, v0, ring_seg, ring_pos)[1]
    carry = (jnp.zeros(q_BTNH.shape, q_BTNH.dtype), jnp.zeros((n, *lse0.shape), lse0.dtype))
    return jax.lax.fori_loop(0, n, one, carry)

  @jax.custom_vjp
  def attend(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT):
    return forward(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT)[0]

  def attend_fwd(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT):
    with jax.named_scope("ring_fwd"):
      out_BTNH, lse = forward(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT)
    return out_BTNH, (q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT, out_BTNH, lse)

  def attend_bwd(res, dout_BTNH):
    q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT, out_BTNH, lse_all = res
    n, per, G = plan(q_BTNH, k_BTKH)
    ring_seg, ring_pos = (seg_BT, pos_BT) if all_to_all is None else all_to_all.gather((seg_BT, pos_BT))

    # rowsum(dO ∘ O) for all heads at once, so a pass needs no slice of the output.
    delta_BTN = jnp.sum(out_BTNH.astype(jnp.float32) * dout_BTNH.astype(jnp.float32), axis=-1)

    def one(i, grads):
      qs, ks = i * per * G, i * per
      q, dout = _heads(q_BTNH, qs, per * G), _heads(dout_BTNH, qs, per * G)
      delta = jax.lax.dynamic_slice_in_dim(delta_BTN, qs, per * G, axis=2)
      k, v = _heads(k_BTKH, ks, per), _heads(v_BTKH, ks, per)
      if all_to_all is not None:
        q, dout, delta, k, v = all_to_all.to_heads(q, dout, delta[..., None], *all_to_all.replicate(k, v))
        delta = delta[..., 0]
      delta = parts.rows(delta, k.shape[2])
      dq, dk, dv = ring_backward(q, k, v, ring_seg, ring_pos, lse_all[i], delta, dout)
      if all_to_all is not None:
        dq, dk, dv = all_to_all.to_tokens(dq, dk, dv)
        dk, dv = all_to_all.unreplicate(dk, dv, per)
      return tuple(jax.lax.dynamic_update_slice_in_dim(full, part.astype(full.dtype), start, axis=2)
                   for full, part, start in zip(grads, (dq, dk, dv), (qs, ks, ks)))

    with jax.named_scope("ring_bwd"):
      grads = (jnp.zeros_like(q_BTNH), jnp.zeros_like(k_BTKH), jnp.zeros_like(v_BTKH))
      dq, dk, dv = jax.lax.fori_loop(0, n, one, grads)
    return dq, dk, dv, None, None

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
