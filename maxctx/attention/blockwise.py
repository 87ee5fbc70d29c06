"""The blockwise kernel: FlashAttention's online softmax in pure JAX, with a custom backward. O(T) memory.

Queries are cut into blocks of `block_q`, keys into blocks of `block_kv`; only one [block_q, block_kv] score tile per
(batch, head) lives at a time. Block pairs the mask hides entirely (`mask.hidden`) are skipped under `lax.cond`, so
causal attention costs about half of full attention and packed documents cost only their own squares.

The kernel is written as three pieces so that the ring can run it across chunks of keys that arrive one at a time:

    state = init(q)                                   # running max, denominator and numerator, float32
    state = forward(state, q, k, v, ...)              # once per chunk of keys; the online softmax carries over
    out, lse = finish(state, dtype)
    dq, dk, dv = backward(q, k, v, ..., lse, delta, do)   # per chunk of keys, float32 partial gradients

The state is in the kernel's own layout ([B, K, G, T, ...], G = N / K query heads per KV head) and is opaque to
callers. `attend` is the single-chunk kernel with its custom_vjp; the backward recomputes scores tile by tile from
(q, k, v, lse) instead of saving them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from maxctx.attention import mask

DEFAULT_BLOCK = 512
_F32 = jnp.float32


def fit_block(block: int | None, length: int) -> int:
  """The largest block ≤ `block` (default 512) that divides `length`."""
  block = min(block or DEFAULT_BLOCK, length)
  while length % block:
    block -= 1
  return block


def _split_heads(x_BTNH, kv_heads):
  B, T, N, H = x_BTNH.shape
  return x_BTNH.reshape(B, T, kv_heads, N // kv_heads, H)


@dataclasses.dataclass(frozen=True)
class Blockwise:
  """The online-softmax pieces with their block sizes. `upcast` computes in float32 (the dense oracle's numerics)."""
  block_q: int | None = None
  block_kv: int | None = None
  upcast: bool = False

  def _blocks(self, tq, tk):
    return fit_block(self.block_q, tq), fit_block(self.block_kv, tk)

  def _cast(self, *xs):
    return tuple(x.astype(_F32) for x in xs) if self.upcast else xs

  def init(self, q_BTNH, kv_heads):
    B, T, N, H = q_BTNH.shape
    G = N // kv_heads
    acc_BKGTH = jnp.zeros((B, kv_heads, G, T, H), _F32)
    max_BKGT = jnp.full((B, kv_heads, G, T), -jnp.inf, _F32)
    return acc_BKGTH, max_BKGT, jnp.zeros((B, kv_heads, G, T), _F32)

  def forward(self, state, q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos):
    """The state after attending q to one more chunk of keys."""
    q_BTNH, k_BSKH, v_BSKH = self._cast(q_BTNH, k_BSKH, v_BSKH)
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    bq, bk = self._blocks(T, S)
    # Scaling q once per chunk saves a pass over every score tile.
    q_BTKGH = _split_heads((q_BTNH * H**-0.5).astype(q_BTNH.dtype), K)
    skip_QS, kind_QS = _tile_kinds(q_seg, kv_seg, q_pos, kv_pos, bq, bk)

    def tile(i, j, masked, carry):
      acc_BKGQH, max_BKGQ, den_BKGQ = carry
      q_BQKGH = jax.lax.dynamic_slice_in_dim(q_BTKGH, i * bq, bq, axis=1)
      k_BSKH_j = jax.lax.dynamic_slice_in_dim(k_BSKH, j * bk, bk, axis=1)
      v_BSKH_j = jax.lax.dynamic_slice_in_dim(v_BSKH, j * bk, bk, axis=1)
      s_BKGQS = jnp.einsum("bqkgh,bskh->bkgqs", q_BQKGH, k_BSKH_j, preferred_element_type=_F32)
      if masked:
        vis_BQS = _tile_mask(q_seg, kv_seg, q_pos, kv_pos, i * bq, j * bk, bq, bk)
        s_BKGQS = jnp.where(vis_BQS[:, None, None], s_BKGQS, -jnp.inf)
      new_max = jnp.maximum(max_BKGQ, jnp.max(s_BKGQS, axis=-1))
      # A row that has seen nothing yet keeps max -inf; shift by 0 there so exp gives 0, not NaN.
      shift = jnp.where(jnp.isneginf(new_max), 0.0, new_max)
      p_BKGQS = jnp.exp(s_BKGQS - shift[..., None])
      rescale = jnp.exp(max_BKGQ - shift)
      den_BKGQ = den_BKGQ * rescale + jnp.sum(p_BKGQS, axis=-1)
      pv_BKGQH = jnp.einsum("bkgqs,bskh->bkgqh", p_BKGQS.astype(v_BSKH.dtype), v_BSKH_j,
                            preferred_element_type=_F32)
      return acc_BKGQH * rescale[..., None] + pv_BKGQH, new_max, den_BKGQ

    def q_block(i, state):
      acc, mx, den = state
      carry = (jax.lax.dynamic_slice_in_dim(acc, i * bq, bq, axis=3),
               jax.lax.dynamic_slice_in_dim(mx, i * bq, bq, axis=3),
               jax.lax.dynamic_slice_in_dim(den, i * bq, bq, axis=3))
      # The switch carries one tile's state only: a switch over the whole state would copy it.
      carry = jax.lax.fori_loop(0, S // bk, lambda j, c: jax.lax.switch(
          kind_QS[i, j], [lambda c: c, functools.partial(tile, i, j, True), functools.partial(tile, i, j, False)], c),
          carry)
      return tuple(jax.lax.dynamic_update_slice_in_dim(full, part, i * bq, axis=3) for full, part in zip(state, carry))

    with jax.named_scope("blockwise_fwd"):
      return jax.lax.fori_loop(0, _trips(skip_QS, T // bq), q_block, state)

  def finish(self, state, dtype):
    """(out [B, T, N, H] in `dtype`, lse in the kernel's layout). Rows that saw no key give zeros and lse -inf."""
    acc_BKGTH, max_BKGT, den_BKGT = state
    B, K, G, T, H = acc_BKGTH.shape
    empty = den_BKGT == 0
    out_BKGTH = acc_BKGTH / jnp.where(empty, 1.0, den_BKGT)[..., None]
    lse_BKGT = jnp.where(empty, -jnp.inf, max_BKGT + jnp.log(jnp.where(empty, 1.0, den_BKGT)))
    out_BTNH = jnp.transpose(out_BKGTH, (0, 3, 1, 2, 4)).reshape(B, T, K * G, H)
    return out_BTNH.astype(dtype), lse_BKGT

  def delta(self, out_BTNH, dout_BTNH, kv_heads):
    """rowsum(dO ∘ O) in the kernel's layout: the softmax backward's correction term."""
    return self.rows(jnp.sum(out_BTNH.astype(_F32) * dout_BTNH.astype(_F32), axis=-1), kv_heads)

  def rows(self, x_BTN, kv_heads):
    """A per-(token, query head) array in the kernel's layout, as lse and delta are kept."""
    B, T, N = x_BTN.shape
    return jnp.transpose(x_BTN.reshape(B, T, kv_heads, N // kv_heads), (0, 2, 3, 1))

  def backward(self, q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, lse_BKGT, delta_BKGT, dout_BTNH,
               grads=None):
    """float32 (dq, dk, dv) of this chunk of keys, given the final lse and delta of the queries, added to `grads`
    (float32 accumulators shaped like q, k, v, updated in place) when given."""
    q_BTNH, k_BSKH, v_BSKH, dout_BTNH = self._cast(q_BTNH, k_BSKH, v_BSKH, dout_BTNH)
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    bq, bk = self._blocks(T, S)
    # With q scaled once, ds · (scaled q) is dk already and only the [block_q, H] dq tile needs the scale.
    scale = H**-0.5
    q_BTKGH, do_BTKGH = _split_heads((q_BTNH * scale).astype(q_BTNH.dtype), K), _split_heads(dout_BTNH, K)
    # A row that saw nothing has lse -inf and every score masked: shift by 0 so exp gives 0.
    lse_BKGT = jnp.where(jnp.isneginf(lse_BKGT), 0.0, lse_BKGT)
    skip_QS, kind_QS = _tile_kinds(q_seg, kv_seg, q_pos, kv_pos, bq, bk)

    def tile(i, j, masked):
      q_BQKGH = jax.lax.dynamic_slice_in_dim(q_BTKGH, i * bq, bq, axis=1)
      do_BQKGH = jax.lax.dynamic_slice_in_dim(do_BTKGH, i * bq, bq, axis=1)
      lse_BKGQ = jax.lax.dynamic_slice_in_dim(lse_BKGT, i * bq, bq, axis=3)
      delta_BKGQ = jax.lax.dynamic_slice_in_dim(delta_BKGT, i * bq, bq, axis=3)
      k_BSKH_j = jax.lax.dynamic_slice_in_dim(k_BSKH, j * bk, bk, axis=1)
      v_BSKH_j = jax.lax.dynamic_slice_in_dim(v_BSKH, j * bk, bk, axis=1)
      s_BKGQS = jnp.einsum("bqkgh,bskh->bkgqs", q_BQKGH, k_BSKH_j, preferred_element_type=_F32)
      p_BKGQS = jnp.exp(s_BKGQS - lse_BKGQ[..., None])
      if masked:
        vis_BQS = _tile_mask(q_seg, kv_seg, q_pos, kv_pos, i * bq, j * bk, bq, bk)
        p_BKGQS = jnp.where(vis_BQS[:, None, None], p_BKGQS, 0.0)
      dv_BSKH = jnp.einsum("bkgqs,bqkgh->bskh", p_BKGQS.astype(do_BQKGH.dtype), do_BQKGH,
                           preferred_element_type=_F32)
      dp_BKGQS = jnp.einsum("bqkgh,bskh->bkgqs", do_BQKGH, v_BSKH_j, preferred_element_type=_F32)
      ds_BKGQS = (p_BKGQS * (dp_BKGQS - delta_BKGQ[..., None])).astype(q_BQKGH.dtype)
      dk_BSKH = jnp.einsum("bkgqs,bqkgh->bskh", ds_BKGQS, q_BQKGH, preferred_element_type=_F32)
      dq_BQKGH = jnp.einsum("bkgqs,bskh->bqkgh", ds_BKGQS, k_BSKH_j, preferred_element_type=_F32) * scale
      return dq_BQKGH, dk_BSKH, dv_BSKH

    def add_at(full, part, start, axis=1):
      return jax.lax.dynamic_update_slice_in_dim(
          full, jax.lax.dynamic_slice_in_dim(full, start, part.shape[axis], axis=axis) + part, start, axis=axis)

    def q_block(j, i, carry):
      dq_BTKGH, dk_BSKH, dv_BSKH = carry
      # The cond yields one tile's gradients; the accumulators stay outside it so nothing large is copied.
      zeros = (jnp.zeros((B, bq, K, N // K, H), _F32), jnp.zeros((B, bk, K, H), _F32), jnp.zeros((B, bk, K, H), _F32))
      dq_tile, dk_tile, dv_tile = jax.lax.switch(
          kind_QS[i, j], [lambda: zeros, functools.partial(tile, i, j, True), functools.partial(tile, i, j, False)])
      return add_at(dq_BTKGH, dq_tile, i * bq), dk_BSKH + dk_tile, dv_BSKH + dv_tile

    def kv_block(j, grads):
      dq_BTKGH, dk_BSKH, dv_BSKH = grads
      zeros = jnp.zeros((B, bk, K, H), _F32)
      dq_BTKGH, dk_tile, dv_tile = jax.lax.fori_loop(0, T // bq, functools.partial(q_block, j),
                                                     (dq_BTKGH, zeros, zeros))
      return dq_BTKGH, add_at(dk_BSKH, dk_tile, j * bk), add_at(dv_BSKH, dv_tile, j * bk)

    with jax.named_scope("blockwise_bwd"):
      if grads is None:
        grads = (jnp.zeros(q_BTNH.shape, _F32), jnp.zeros((B, S, K, H), _F32), jnp.zeros((B, S, K, H), _F32))
      dq_BTNH, dk_BSKH, dv_BSKH = grads
      dq_BTKGH, dk_BSKH, dv_BSKH = jax.lax.fori_loop(0, _trips(skip_QS, S // bk), kv_block,
                                                     (_split_heads(dq_BTNH, K), dk_BSKH, dv_BSKH))
    return dq_BTKGH.reshape(B, T, N, H), dk_BSKH, dv_BSKH


def _tile_mask(q_seg, kv_seg, q_pos, kv_pos, q_start, kv_start, bq, bk):
  def q_part(x):
    return jax.lax.dynamic_slice_in_dim(x, q_start, bq, axis=1)

  def kv_part(x):
    return jax.lax.dynamic_slice_in_dim(x, kv_start, bk, axis=1)

  return mask.visible(q_part(q_seg), kv_part(kv_seg), q_part(q_pos), kv_part(kv_pos))


def _tile_kinds(q_seg, kv_seg, q_pos, kv_pos, bq, bk):
  """(hidden [nq, nk], kind [nq, nk]): kind 0 skips a hidden tile, 1 computes it under the mask, 2 computes a tile
  the mask fully shows without building the mask."""
  q_summary, kv_summary = mask.summarize(q_seg, q_pos, bq), mask.summarize(kv_seg, kv_pos, bk)
  hidden = mask.hidden(q_summary, kv_summary)
  return hidden, jnp.where(hidden, 0, jnp.where(mask.full(q_summary, kv_summary), 2, 1))


def _trips(skip_QS, n):
  """n, or 0 when the mask hides every tile pair: a whole chunk pair is skipped without visiting its tiles."""
  return jnp.where(jnp.all(skip_QS), 0, n)


def attend_fn(parts: Blockwise):
  """Single-chunk attention (q against all of k, v) with a custom backward that saves only q, k, v, out and lse."""

  @jax.custom_vjp
  def attend(q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos):
    return fwd(q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos)[0]

  def fwd(q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos):
    K = k_BSKH.shape[2]
    state = parts.forward(parts.init(q_BTNH, K), q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos)
    out_BTNH, lse = parts.finish(state, q_BTNH.dtype)
    return out_BTNH, (q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, out_BTNH, lse)

  def bwd(res, dout_BTNH):
    q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, out_BTNH, lse = res
    delta = parts.delta(out_BTNH, dout_BTNH, k_BSKH.shape[2])
    dq, dk, dv = parts.backward(q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, lse, delta, dout_BTNH)
    return dq.astype(q_BTNH.dtype), dk.astype(k_BSKH.dtype), dv.astype(v_BSKH.dtype), None, None, None, None

  attend.defvjp(fwd, bwd)
  return attend
