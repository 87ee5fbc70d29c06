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
least U query heads per pass): in-flight memory is one group's (or one sub-chunk of it, below), and everything else
is O(T/P). A group is as many KV heads as keep one hop's K and V within `PASS_BYTES`, at least one: long chunks go
one head at a time, short ones batch heads so that each hop's collectives and kernel calls carry enough work to
outweigh their fixed cost per launch. When even one head is larger and its
K/V would outweigh a share of the pass's query state (`KV_SHARE`), the pass sends its tokens in sub-chunks, each round
the whole ring in turn (USP all-to-alls each sub-chunk on its own): the same bytes in more, smaller hops. This is what
keeps USP's memory near the ring's: its pass holds the all-to-all group's U·T/P tokens, so whole hops would carry U×
the ring's K/V.

`ring_attention` works on any cycle of the axis, so USP reuses it across its groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxctx import scopes, sharding
from maxctx.attention import kernels
from maxctx.attention.blockwise import Blockwise, fit_block, keep
from maxctx.attention.registry import Strategy, Traffic, ids_bytes, register
from maxctx.attention.ulysses import AllToAll, kv_replication

# The most bytes of K and V (as given, before any USP replication) that one hop of a pass may carry, unless a single
# KV head needs more. The backward's hops also carry float32 dK/dV: up to 3× this for bfloat16 K/V.
PASS_BYTES = 2 * 2**20
# When a single KV head's chunk exceeds PASS_BYTES, its tokens travel in sub-chunks whose hop carries at most
# 1/KV_SHARE of the pass's query-side bytes (its queries and their float32 numerator), where the kernel's key blocks
# allow: K/V in flight (the sub-chunk computed on and the one arriving) then stays within a quarter of the state the
# queries need anyway.
KV_SHARE = 8


def pass_plan(q_BTNH, k_BTKH, degree: int = 1, block_kv: int | None = None, fit_kv=None):
  """(passes, KV heads per pass, query heads per KV head, sub-chunks per hop) for local q and K shaped like these,
  under an all-to-all of `degree` (USP; 1 is the ring). A pass takes the most KV heads whose K and V (as given)
  stay within `PASS_BYTES` per hop, or else the fewest; either way a divisor of K whose query heads the all-to-all
  splits. When even the fewest exceed it, the local tokens travel in the fewest sub-chunks whose hop (K and V as
  carried, after USP's KV head copies) is at most 1/`KV_SHARE` of the pass's query-side bytes; a sub-chunk must be a
  whole number of the kernel's key blocks (the kernel's `fit_kv(length)` when given, else `block_kv` as blockwise
  fits it, either fit to the unsplit chunk), and when no count reaches the share the most that the blocks allow is
  taken (the `reference` kernel's one block: none)."""
  N, K = q_BTNH.shape[2], k_BTKH.shape[2]
  G = N // K
  valid = [d for d in range(1, K + 1) if K % d == 0 and d * G % degree == 0]
  B, T, _, H = k_BTKH.shape
  head_bytes = 2 * B * T * H * jnp.dtype(k_BTKH.dtype).itemsize
  fitting = [d for d in valid if d * head_bytes <= PASS_BYTES]   # read at call time, so tests can lower it
  per = max(fitting) if fitting else min(valid)
  if fitting:
    return K // per, per, G, 1
  # A hop carries the pass's KV heads as replicated for the all-to-all; after it, its tokens are degree × T.
  hop_bytes = per * kv_replication(per, degree) * head_bytes
  query_bytes = per * G * B * T * H * (jnp.dtype(q_BTNH.dtype).itemsize + 4)
  block = (fit_kv or (lambda length: fit_block(block_kv, length)))(degree * T)
  cuts = [s for s in range(1, T + 1) if T % s == 0 and degree * T // s % block == 0]
  return K // per, per, G, next((s for s in cuts if hop_bytes / s <= query_bytes / KV_SHARE), cuts[-1])


def _heads(x, start, size):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=2)


def _block(x_BTKH, token, tokens, head, heads):
  """Tokens [token, token + tokens) of heads [head, head + heads): one slice, no intermediate copy of either."""
  B, _, _, H = x_BTKH.shape
  return jax.lax.dynamic_slice(x_BTKH, (0, token, head, 0), (B, tokens, heads, H))


def _put(full, part, token, head):
  """full[:, token:, head:] = part (cast to full's dtype), for [B, T, heads, H] arrays."""
  return jax.lax.dynamic_update_slice(full, part.astype(full.dtype), (0, token, head, 0))


def ring_attention(parts: Blockwise, axis: str, perm: list[tuple[int, int]], hops: int,
                   all_to_all: AllToAll | None = None):
  """Per-device fn(q, k, v, segment_ids, positions) -> out: the local queries attend to the K/V of all `hops`
  devices on the cycle `perm` of `axis` (each device's queries and K/V share its segment ids and positions).

  With `all_to_all` (USP), each pass first moves its queries from token to head sharding inside the all-to-all
  groups, then each sub-chunk of its K/V the same way before that sub-chunk's ring over the groups, and moves the
  output back; the backward does the same with the gradients.
  """
  ring = _Ring(parts, axis, perm, hops, all_to_all)

  @jax.custom_vjp
  def attend(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT):
    return ring.forward(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT)[0]

  def attend_fwd(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT):
    with jax.named_scope("ring_fwd"):
      out_BTNH, lse = keep(*ring.forward(q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT))
    return out_BTNH, (q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT, out_BTNH, lse)

  def attend_bwd(res, dout_BTNH):
    with jax.named_scope("ring_bwd"):
      return (*ring.backward(*res, dout_BTNH), None, None)

  attend.defvjp(attend_fwd, attend_bwd)
  return attend


class _Ring:
  """The passes (groups of heads), sub-chunks and hops of one ring (or USP) attention; see `ring_attention`."""

  def __init__(self, parts: Blockwise, axis: str, perm: list[tuple[int, int]], hops: int,
               all_to_all: AllToAll | None):
    self.parts, self.axis, self.perm, self.hops, self.all_to_all = parts, axis, perm, hops, all_to_all
    self.degree = all_to_all.degree if all_to_all else 1

  def send(self, x):
    return jax.lax.ppermute(x, self.axis, self.perm)

  def group_ids(self, seg_BT, pos_BT):
    """The queries' segment ids and positions as the kernel sees them (USP: the group's, gathered), and the two
    stacked as [2, B, degree, T] by group member, for `ring_chunk` to slice a sub-chunk's from: the all-to-all
    concatenates the members' tokens in member order, as the gather does."""
    a2a = self.all_to_all
    ring_seg, ring_pos = (seg_BT, pos_BT) if a2a is None else a2a.gather((seg_BT, pos_BT))
    return ring_seg, ring_pos, jnp.stack([ring_seg, ring_pos]).reshape(2, seg_BT.shape[0], self.degree, -1)

  def ring_chunk(self, k_BTKH, v_BTKH, ids_2BUT, start, size, head, heads):
    """Tokens [start, start + size) of the local K/V's heads [head, head + heads) as the ring carries them (USP:
    all-to-all'd to head sharding), with their ids taken from `group_ids`."""
    k_BCKH, v_BCKH = _block(k_BTKH, start, size, head, heads), _block(v_BTKH, start, size, head, heads)
    if self.all_to_all is not None:
      k_BCKH, v_BCKH = self.all_to_all.to_heads(*self.all_to_all.replicate(k_BCKH, v_BCKH))
    ids_2BUC = jax.lax.dynamic_slice_in_dim(ids_2BUT, start, size, axis=3)
    return k_BCKH, v_BCKH, ids_2BUC.reshape(*ids_2BUC.shape[:2], self.degree * size)

  # K and V travel as two arrays, not stacked: the kernel's loops take each as an operand, and slices of a stack
  # made XLA copy both out of it on every hop. Segment ids and positions travel stacked (they are small).
  def ring_forward(self, state, q_BTNH, k_BSKH, v_BSKH, ids_2BS, seg_BT, pos_BT, first_head):
    """The state after the queries met every device's chunk; with `first_head`, q holds more heads than the
    state and the pass reads its own in place."""
    def visit(state, k, v, ids_2BS):
      return self.parts.forward(state, q_BTNH, k, v, seg_BT, ids_2BS[0], pos_BT, ids_2BS[1], first_head=first_head)

    def hop(carry, _):
      state, *chunk = carry
      with jax.named_scope("ring_ppermute_kv"):
        incoming = self.send(tuple(chunk))   # issued before the compute on this chunk so the transfer overlaps it
      return (visit(state, *chunk), *incoming), None

    (state, *chunk), _ = jax.lax.scan(hop, (state, k_BSKH, v_BSKH, ids_2BS), length=self.hops - 1)
    return visit(state, *chunk)

  def ring_backward(self, dq_BTNH, q_BTNH, k_BSKH, v_BSKH, ids_2BS, seg_BT, pos_BT, lse_BNT, delta_BNT, dout_BTNH,
                    first_head):
    """(dq + this chunk's share, dk, dv): dq has lse's heads; with `first_head`, q, dout and delta hold all heads
    and the pass reads its own in place."""
    def hop(carry, _):
      dq_BTNH, k_BSKH, v_BSKH, ids_2BS, dk_BSKH, dv_BSKH = carry
      with jax.named_scope("ring_ppermute_kv"):
        incoming = self.send((k_BSKH, v_BSKH, ids_2BS))
      dq_BTNH, dk_BSKH, dv_BSKH = self.parts.backward(
          q_BTNH, k_BSKH, v_BSKH, seg_BT, ids_2BS[0], pos_BT, ids_2BS[1], lse_BNT, delta_BNT, dout_BTNH,
          grads=(dq_BTNH, dk_BSKH, dv_BSKH), first_head=first_head)
      with jax.named_scope("ring_ppermute_dkv"):
        # The accumulators travel with their chunk; this hop overlaps the next chunk's compute.
        dk_BSKH, dv_BSKH = self.send((dk_BSKH, dv_BSKH))
      return (dq_BTNH, *incoming, dk_BSKH, dv_BSKH), None

    zeros = jnp.zeros(k_BSKH.shape, jnp.float32)
    carry, _ = jax.lax.scan(hop, (dq_BTNH, k_BSKH, v_BSKH, ids_2BS, zeros, zeros), length=self.hops - 1)
    (dq, _, _, _, dk, dv), _ = hop(carry, None)   # the last hop's K/V send is dead code, dropped by XLA
    return dq, dk, dv

  def pass_loop(self, n, body, carry):
    """fori_loop(0, n, body, carry) with n as a bound XLA cannot see: a one-trip loop would be inlined, and on XLA:CPU
    the ring's collectives then sat beside the layer's other collectives with nothing ordering them; devices ran them
    in different orders and the step deadlocked (seen with one pass of all heads in tests/test_resume.py). So that
    the compiled step's collective bytes still count every pass, the loop's op name carries n (scopes.trips, read by
    maxctx.compile.hlo)."""
    with jax.named_scope(scopes.trips(n)):
      return jax.lax.fori_loop(0, n + jnp.minimum(jax.lax.axis_index(self.axis), 0), body, carry)

  def plan(self, q_BTNH, k_BTKH):
    return pass_plan(q_BTNH, k_BTKH, self.degree, fit_kv=self.parts.fit_kv)

  def forward(self, q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT):
    """(out [B, T, N, H], every pass's lse [passes, B, heads per pass, T])."""
    parts, a2a = self.parts, self.all_to_all
    n, per, G, subs = self.plan(q_BTNH, k_BTKH)
    C = k_BTKH.shape[1] // subs
    ring_seg, ring_pos, ids_2BUT = self.group_ids(seg_BT, pos_BT)
    # The queries one pass attends, as the kernel sees them (USP: after the all-to-all); only the shape is used.
    pass_q = jax.ShapeDtypeStruct((*q_BTNH.shape[:2], per * G, q_BTNH.shape[3]), q_BTNH.dtype)
    if a2a is not None:
      pass_q = jax.eval_shape(a2a.to_heads, pass_q)

    def one(i, carry):
      out_BTNH, lse_all = carry
      qs, ks = i * per * G, i * per
      q, first = (q_BTNH, qs) if a2a is None else (a2a.to_heads(_heads(q_BTNH, qs, per * G)), None)

      def sub(s, state):
        chunk = self.ring_chunk(k_BTKH, v_BTKH, ids_2BUT, s * C, C, ks, per)
        return self.ring_forward(state, q, *chunk, ring_seg, ring_pos, first)

      state = parts.init(pass_q)
      out, lse = parts.finish(sub(0, state) if subs == 1 else jax.lax.fori_loop(0, subs, sub, state), q_BTNH.dtype)
      if a2a is not None:
        out = a2a.to_tokens(out)
      return _put(out_BTNH, out, 0, qs), jax.lax.dynamic_update_index_in_dim(lse_all, lse, i, axis=0)

    B, T, N, _ = pass_q.shape
    carry = (jnp.zeros(q_BTNH.shape, q_BTNH.dtype), jnp.zeros((n, B, N, T), jnp.float32))   # out, every pass's lse
    return self.pass_loop(n, one, carry)

  def backward(self, q_BTNH, k_BTKH, v_BTKH, seg_BT, pos_BT, out_BTNH, lse_all, dout_BTNH):
    """(dq, dk, dv) from the forward's residuals and the output's cotangent."""
    a2a = self.all_to_all
    n, per, G, subs = self.plan(q_BTNH, k_BTKH)
    C = k_BTKH.shape[1] // subs
    ring_seg, ring_pos, ids_2BUT = self.group_ids(seg_BT, pos_BT)
    # rowsum(dO ∘ O) for all heads at once, so a pass needs no slice of the output.
    delta_BNT = self.parts.delta(out_BTNH, dout_BTNH)

    def one(i, grads):
      dq_full, dk_full, dv_full = grads
      qs, ks = i * per * G, i * per
      if a2a is None:
        q, dout, delta, first = q_BTNH, dout_BTNH, delta_BNT, qs
      else:
        q, dout = _heads(q_BTNH, qs, per * G), _heads(dout_BTNH, qs, per * G)
        delta_BTN = jnp.swapaxes(jax.lax.dynamic_slice_in_dim(delta_BNT, qs, per * G, axis=1), 1, 2)
        q, dout, delta = a2a.to_heads(q, dout, delta_BTN[..., None])
        delta, first = jnp.swapaxes(delta[..., 0], 1, 2), None
      B, N, T = lse_all[i].shape

      def sub(s, carry):
        dq, dk_full, dv_full = carry
        chunk = self.ring_chunk(k_BTKH, v_BTKH, ids_2BUT, s * C, C, ks, per)
        dq, dk, dv = self.ring_backward(dq, q, *chunk, ring_seg, ring_pos, lse_all[i], delta, dout, first)
        if a2a is not None:
          dk, dv = a2a.unreplicate(*a2a.to_tokens(dk, dv), per)
        return dq, _put(dk_full, dk, s * C, ks), _put(dv_full, dv, s * C, ks)

      carry = (jnp.zeros((B, T, N, q_BTNH.shape[3]), jnp.float32), dk_full, dv_full)
      dq, dk_full, dv_full = sub(0, carry) if subs == 1 else jax.lax.fori_loop(0, subs, sub, carry)
      if a2a is not None:
        dq = a2a.to_tokens(dq)
      return _put(dq_full, dq, 0, qs), dk_full, dv_full

    grads = (jnp.zeros_like(q_BTNH), jnp.zeros_like(k_BTKH), jnp.zeros_like(v_BTKH))
    return self.pass_loop(n, one, grads)


def ring_buffer_bytes(kv_elements: float, dtype_bytes: int) -> float:
  """A ring's blocks in flight, from one device's K (or V) elements: the K/V block it works on and the one arriving,
  and their float32 dK/dV accumulators, also two (one travelling)."""
  return 2 * 2 * kv_elements * (dtype_bytes + 4)


def ring_traffic(hops: int, kv_bytes: float, ids: float, dkv_bytes: float) -> tuple[float, float]:
  """(forward, backward) collective-permute bytes of one layer's ring: K/V (`kv_bytes` a hop) and their ids travel
  hops - 1 times each way; in the backward the float32 dK/dV accumulators (`dkv_bytes`) travel all `hops` to come
  home. Passes and sub-chunks split the same bytes into more hops, so they do not enter."""
  return (hops - 1) * (kv_bytes + ids), (hops - 1) * (kv_bytes + ids) + hops * dkv_bytes


@register
class Ring(Strategy):
  name = "ring"

  def validate(self, p):
    super().validate(p)
    self.require_chunked(p, self.name)

  def buffer_bytes(self, p, rows, head_dim, dtype_bytes):
    return ring_buffer_bytes(rows * p.seq_len // p.context * (p.n_kv_heads // p.tensor) * head_dim, dtype_bytes)

  def traffic(self, p, rows, head_dim, dtype_bytes):
    t = p.seq_len // p.context
    kv = 2 * rows * t * (p.n_kv_heads // p.tensor) * head_dim
    fwd, bwd = ring_traffic(p.context, kv * dtype_bytes, ids_bytes(rows, t), kv * 4)
    return Traffic(forward={"collective-permute": fwd}, backward={"collective-permute": bwd})

  def build(self, mesh, a):
    hops = mesh.shape[sharding.SEQ_AXIS]
    perm = [(i, (i + 1) % hops) for i in range(hops)]
    return self.shard(mesh, ring_attention(kernels.parts(a.kernel, a.block_q, a.block_kv), sharding.SEQ_AXIS, perm,
                                           hops))
