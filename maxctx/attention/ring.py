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
all heads travelled at once, so the ring runs in passes over groups of KV heads (with their query heads; USP needs at
least U query heads per pass): in-flight memory is one group's, and everything else is O(T/P). A group is as many
KV heads as keep one hop's K and V within `PASS_BYTES`, at least one: long chunks go one head at a time, short ones
batch heads so that each hop's collectives and kernel calls carry enough work (on the CPU, T = 8192 over 8 devices
ran 7% faster with 4 heads per pass than with one).

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

# The most bytes of K and V (as given, before any USP replication) that one hop of a pass may carry, unless a single
# KV head needs more. The backward's hops also carry float32 dK/dV: up to 3× this for bfloat16 K/V.
PASS_BYTES = 2 * 2**20


def _heads(x, start, size):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=2)


def ring_attention(parts: Blockwise, axis: str, perm: list[tuple[int, int]], hops: int,
                   all_to_all: AllToAll | None = None, pass_bytes: int | None = None):
  """Per-device fn(q, k, v, segment_ids, positions) -> out: the local queries attend to the K/V of all `hops`
  devices on the cycle `perm` of `axis` (each device's queries and K/V share its segment ids and positions).

  With `all_to_all` (USP), each pass first moves its heads from token to head sharding inside the all-to-all
  groups, runs the ring over the groups, and moves the output back; the backward does the same with the gradients.
  """
  degree = all_to_all.degree if all_to_all else 1

  def send(x):
    return jax.lax.ppermute(x, axis, perm)

  # K and V travel as two arrays, not stacked: the kernel's loops take each as an operand, and slices of a stack
  # made XLA copy both out of it on every hop. Segment ids and positions travel stacked (they are small).
  def ring_forward(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT, heads=None):
    """With `heads` = (first, count), the pass attends q's heads [first, first + count), read in place."""
    first, count = heads if heads is not None else (None, q_BTNH.shape[2])

    def visit(state, k, v, ids_2BT):
      return parts.forward(state, q_BTNH, k, v, seg_BT, ids_2BT[0], pos_BT, ids_2BT[1], first_head=first)

    def hop(carry, _):
      state, *chunk = carry
      with jax.named_scope("ring_ppermute_kv"):
        incoming = send(tuple(chunk))   # issued before the compute on this chunk so the transfer overlaps it
      return (visit(state, *chunk), *incoming), None

    pass_q = jax.ShapeDtypeStruct((*q_BTNH.shape[:2], count, q_BTNH.shape[3]), q_BTNH.dtype)
    carry = (parts.init(pass_q), k_BTKH, v_BTKH, jnp.stack([seg_BT, pos_BT]))
    (state, *chunk), _ = jax.lax.scan(hop, carry, length=hops - 1)
    return parts.finish(visit(state, *chunk), q_BTNH.dtype)

  def ring_backward(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT, lse_BNT, delta_BNT, dout_BTNH, first_head=None):
    """dq has lse's heads; with `first_head`, q, dout and delta hold all heads and the pass reads its own in place."""
    def hop(carry, _):
      dq_BTNH, k_BSKH, v_BSKH, ids_2BS, dk_BSKH, dv_BSKH = carry
      with jax.named_scope("ring_ppermute_kv"):
        incoming = send((k_BSKH, v_BSKH, ids_2BS))
      dq_BTNH, dk_BSKH, dv_BSKH = parts.backward(
          q_BTNH, k_BSKH, v_BSKH, seg_BT, ids_2BS[0], pos_BT, ids_2BS[1], lse_BNT, delta_BNT, dout_BTNH,
          grads=(dq_BTNH, dk_BSKH, dv_BSKH), first_head=first_head)
      with jax.named_scope("ring_ppermute_dkv"):
        # The accumulators travel with their chunk; this hop overlaps the next chunk's compute.
        dk_BSKH, dv_BSKH = send((dk_BSKH, dv_BSKH))
      return (dq_BTNH, *incoming, dk_BSKH, dv_BSKH), None

    zeros = jnp.zeros(k_BTKH.shape, jnp.float32)
    B, N, T = lse_BNT.shape
    carry = (jnp.zeros((B, T, N, q_BTNH.shape[3]), jnp.float32), k_BTKH, v_BTKH, jnp.stack([seg_BT, pos_BT]),
             zeros, zeros)
    carry, _ = jax.lax.scan(hop, carry, length=hops - 1)
    (dq, _, _, _, dk, dv), _ = hop(carry, None)   # the last hop's K/V send is dead code, dropped by XLA
    return dq, dk, dv

  def passes(n):
    """n as a loop bound XLA cannot see: a one-trip loop would be inlined, and on XLA:CPU the ring's collectives then
    sat beside the layer's other collectives with nothing ordering them; devices ran them in different orders and the
    step deadlocked (seen with one pass of all heads in tests/test_resume.py)."""
    return n + jnp.minimum(jax.lax.axis_index(axis), 0)

  def plan(q_BTNH, k_BTKH):
    """(passes, KV heads per pass, query heads per KV head): the most KV heads per pass whose K and V stay within
    `pass_bytes` per hop, or else the fewest; either way a divisor of K whose query heads the all-to-all splits."""
    N, K = q_BTNH.shape[2], k_BTKH.shape[2]
    G = N // K
    valid = [d for d in range(1, K + 1) if K % d == 0 and d * G % degree == 0]
    head_bytes = 2 * k_BTKH.shape[0] * k_BTKH.shape[1] * k_BTKH.shape[3] * k_BTKH.dtype.itemsize
    budget = PASS_BYTES if pass_bytes is None else pass_bytes   # read at call time, so tests can lower it
    fitting = [d for d in valid if d * head_bytes <= budget]
    per = max(fitting) if fitting else min(valid)
    return K // per, per, G

  def forward(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT):
    n, per, G = plan(q_BTNH, k_BTKH)
    ring_seg, ring_pos = (seg_BT, pos_BT) if all_to_all is None else all_to_all.gather((seg_BT, pos_BT))

    def one(i, carry):
      out_BTNH, lse_all = carry
      k, v = _heads(k_BTKH, i * per, per), _heads(v_BTKH, i * per, per)
      if all_to_all is None:
        out, lse = ring_forward(q_BTNH, k, v, ring_seg, ring_pos, heads=(i * per * G, per * G))
      else:
        q, k, v = all_to_all.to_heads(_heads(q_BTNH, i * per * G, per * G), *all_to_all.replicate(k, v))
        out, lse = ring_forward(q, k, v, ring_seg, ring_pos)
        out = all_to_all.to_tokens(out)
      return (jax.lax.dynamic_update_slice_in_dim(out_BTNH, out, i * per * G, axis=2),
              jax.lax.dynamic_update_index_in_dim(lse_all, lse, i, axis=0))

    q0, k0, v0 = (jax.ShapeDtypeStruct((*x.shape[:2], h, x.shape[3]), x.dtype)
                  for x, h in ((q_BTNH, per * G), (k_BTKH, per), (v_BTKH, per)))
    if all_to_all is not None:
      q0, k0, v0 = jax.eval_shape(lambda q, k, v: all_to_all.to_heads(q, *all_to_all.replicate(k, v)), q0, k0, v0)
    lse0 = jax.eval_shape(lambda *a: ring_forward(*a)[1], q0, k0, v0, ring_seg, ring_pos)
    carry = (jnp.zeros(q_BTNH.shape, q_BTNH.dtype), jnp.zeros((n, *lse0.shape), lse0.dtype))
    return jax.lax.fori_loop(0, passes(n), one, carry)

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
    delta_BNT = parts.delta(out_BTNH, dout_BTNH)

    def one(i, grads):
      qs, ks = i * per * G, i * per
      k, v = _heads(k_BTKH, ks, per), _heads(v_BTKH, ks, per)
      if all_to_all is None:
        dq, dk, dv = ring_backward(q_BTNH, k, v, ring_seg, ring_pos, lse_all[i], delta_BNT, dout_BTNH, first_head=qs)
      else:
        q, dout = _heads(q_BTNH, qs, per * G), _heads(dout_BTNH, qs, per * G)
        delta_BTN = jnp.swapaxes(jax.lax.dynamic_slice_in_dim(delta_BNT, qs, per * G, axis=1), 1, 2)
        q, dout, delta, k, v = all_to_all.to_heads(q, dout, delta_BTN[..., None], *all_to_all.replicate(k, v))
        dq, dk, dv = ring_backward(q, k, v, ring_seg, ring_pos, lse_all[i], jnp.swapaxes(delta[..., 0], 1, 2), dout)
        dq, dk, dv = all_to_all.to_tokens(dq, dk, dv)
        dk, dv = all_to_all.unreplicate(dk, dv, per)
      return tuple(jax.lax.dynamic_update_slice_in_dim(full, part.astype(full.dtype), start, axis=2)
                   for full, part, start in zip(grads, (dq, dk, dv), (qs, ks, ks)))

    with jax.named_scope("ring_bwd"):
      grads = (jnp.zeros_like(q_BTNH), jnp.zeros_like(k_BTKH), jnp.zeros_like(v_BTKH))
      dq, dk, dv = jax.lax.fori_loop(0, passes(n), one, grads)
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
