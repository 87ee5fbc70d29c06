"""The blockwise kernel: FlashAttention's online softmax in pure JAX, with a custom backward. O(T) memory.

Queries are cut into blocks of `block_q`, keys into blocks of `block_kv`; only one [block_q·G, block_kv] score tile
per (batch, KV head) lives at a time. Block pairs the mask hides entirely (`mask.hidden`) are skipped under
`lax.cond`, so causal attention costs about half of full attention and packed documents cost only their own squares.

The kernel is written in pieces so that the ring can run it across chunks of keys that arrive one at a time:

    state = init(q)                                   # running max, denominator and numerator, float32
    state = forward(state, q, k, v, ...)              # once per chunk of keys; the online softmax carries over
    out, lse = finish(state, dtype)
    delta = delta(out, do)
    dq, dk, dv = backward(q, k, v, ..., lse, delta, do)   # per chunk of keys, float32 partial gradients

Tiles are plain matrix products: per (batch, KV head), a block of bq queries with its G = N / K query heads is one
[bq·G, H] matrix of rows (token-major), and a block of keys one [bk, H] matrix. Blocks move into that layout as they
are sliced, so the kernel holds no reordered copy of q, k, v or the gradients, and each tile is one plain matrix
product, which backends run as a single GEMM without first transposing a multi-axis contraction. The numerator is
laid out like q ([B, T, N, H]), so finishing it moves nothing; per-row values (running max, denominator, lse, delta)
are [B, N, T], tokens minor, which a TPU's tiled layouts store unpadded. The state is otherwise opaque to callers.
`attend` is the single-chunk kernel with its custom_vjp; the backward recomputes scores tile by tile from (q, k, v, lse) instead of saving them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxctx.attention import mask
from maxctx.chunks import divisor_at_most

DEFAULT_BLOCK = 512
_F32 = jnp.float32
# The name of what a custom backward needs from its forward (the output and the float32 lse), for remat policies
# that save it: `model.remat: save_attention_out` then runs no attention forward in the backward. The residuals of a
# custom_vjp are its own values, not the output the caller names, so the kernels name them where they are made.
RESIDUALS = "attention_residuals"


def keep(out_BTNH, lse):
  """(out, lse) named `RESIDUALS`. The lse is named flat: stacked over a scan's layers, a [.., heads, tokens] array
  is laid out on a TPU with its few heads in the 128 lanes (32× its size: 2 GiB for 64 MiB at 1M tokens on
  v5p-128); a flat one is not padded."""
  return checkpoint_name(out_BTNH, RESIDUALS), checkpoint_name(lse.reshape(-1), RESIDUALS).reshape(lse.shape)


def fit_block(block: int | None, length: int) -> int:
  """The largest block ≤ `block` (default 512) that divides `length`."""
  return divisor_at_most(block or DEFAULT_BLOCK, length)


def _rows(x_BTN_, kv_heads):
  """[B, T, N, ...] -> [B, K, T, G, ...]: the row layout of a per-(token, query head) array."""
  B, T, N = x_BTN_.shape[:3]
  return jnp.swapaxes(x_BTN_.reshape(B, T, kv_heads, N // kv_heads, *x_BTN_.shape[3:]), 1, 2)


def _merge(x_BKTG_):
  """[B, K, T, G, ...] -> [B, K, T·G, ...]: tokens and their query heads as one axis of rows."""
  return x_BKTG_.reshape(*x_BKTG_.shape[:2], -1, *x_BKTG_.shape[4:])


def _q_tile(x_BTN_, start, size, kv_heads, heads=None):
  """Tokens [start, start + size) of a [B, T, N, ...] array as rows: [B, K, size·G, ...]. With `heads` = (first,
  count), only query heads [first, first + count) of x, read in place rather than from a copy."""
  first, count = heads if heads is not None else (0, x_BTN_.shape[2])
  x = jax.lax.dynamic_slice(x_BTN_, (0, start, first, *[0] * (x_BTN_.ndim - 3)),
                            (x_BTN_.shape[0], size, count, *x_BTN_.shape[3:]))
  return _merge(_rows(x, kv_heads))


def _unrows(x_BKR_, size):
  """Undo `_q_tile`'s layout: [B, K, size·G, ...] -> [B, size, N, ...]."""
  B, K, R = x_BKR_.shape[:3]
  x_BKTG_ = x_BKR_.reshape(B, K, size, R // size, *x_BKR_.shape[3:])
  return jnp.swapaxes(x_BKTG_, 1, 2).reshape(B, size, K * (R // size), *x_BKR_.shape[3:])


def _row_tile(x_BNT, start, size, kv_heads, heads=None):
  """Tokens [start, start + size) of a per-(query head, token) [B, N, T] array, in `_q_tile`'s row order:
  [B, K, size·G]. `heads` as in `_q_tile`."""
  first, count = heads if heads is not None else (0, x_BNT.shape[1])
  x_BNQ = jax.lax.dynamic_slice(x_BNT, (0, first, start), (x_BNT.shape[0], count, size))
  return _merge(_rows(jnp.swapaxes(x_BNQ, 1, 2), kv_heads))


def _unrow_tile(x_BKR, size):
  """Undo `_row_tile`: [B, K, size·G] -> [B, N, size]."""
  return jnp.swapaxes(_unrows(x_BKR, size), 1, 2)


def _kv_tile(x_BSKH, start, size):
  """Keys [start, start + size) of a [B, S, K, H] array: [B, K, size, H]."""
  return jnp.swapaxes(jax.lax.dynamic_slice_in_dim(x_BSKH, start, size, axis=1), 1, 2)


def _rows_mask(vis_BQS, groups):
  """A tile's [B, Q, S] mask repeated over the G query heads of its rows: [B, 1, Q·G, S]."""
  B, Q, S = vis_BQS.shape
  return jnp.broadcast_to(vis_BQS[:, :, None], (B, Q, groups, S)).reshape(B, 1, Q * groups, S)


def _add_at(full, part, start):
  """full[:, start:start + len(part)] += part, along axis 1."""
  return jax.lax.dynamic_update_slice_in_dim(
      full, jax.lax.dynamic_slice_in_dim(full, start, part.shape[1], axis=1) + part, start, axis=1)


@dataclasses.dataclass(frozen=True)
class Blockwise:
  """The online-softmax pieces with their block sizes. `upcast` computes in float32 (the dense oracle's numerics)."""
  block_q: int | None = None
  block_kv: int | None = None
  upcast: bool = False

  def _blocks(self, tq, tk):
    return fit_block(self.block_q, tq), self.fit_kv(tk)

  def fit_kv(self, length: int) -> int:
    """The key block this kernel uses for `length` keys (the ring cuts sub-chunks in whole blocks)."""
    return fit_block(self.block_kv, length)

  def _cast(self, *xs):
    return tuple(x.astype(_F32) for x in xs) if self.upcast else xs

  def init(self, q_BTNH):
    """The empty state for q's heads; only q's shape is read."""
    B, T, N, H = q_BTNH.shape
    return jnp.zeros((B, T, N, H), _F32), jnp.full((B, N, T), -jnp.inf, _F32), jnp.zeros((B, N, T), _F32)

  def forward(self, state, q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, first_head=None):
    """The state after attending q to one more chunk of keys. With `first_head`, q may hold more heads than the
    state: the state's heads are q's [first_head, first_head + N), read in place (the ring's passes copy no q)."""
    q_BTNH, k_BSKH, v_BSKH = self._cast(q_BTNH, k_BSKH, v_BSKH)
    B, T, _, H = q_BTNH.shape
    N = state[0].shape[2]
    heads = None if first_head is None else (first_head, N)
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    G = N // K
    bq, bk = self._blocks(T, S)
    skip_QS, kind_QS = _tile_kinds(q_seg, kv_seg, q_pos, kv_pos, bq, bk)

    def tile(i, j, masked, q_BKRH, carry):
      acc_BKRH, max_BKR, den_BKR = carry
      k_BKSH, v_BKSH = _kv_tile(k_BSKH, j * bk, bk), _kv_tile(v_BSKH, j * bk, bk)
      s_BKRS = jnp.einsum("bkrh,bksh->bkrs", q_BKRH, k_BKSH, preferred_element_type=_F32)
      if masked:
        vis_BQS = _tile_mask(q_seg, kv_seg, q_pos, kv_pos, i * bq, j * bk, bq, bk)
        s_BKRS = jnp.where(_rows_mask(vis_BQS, G), s_BKRS, -jnp.inf)
      new_max = jnp.maximum(max_BKR, jnp.max(s_BKRS, axis=-1))
      # A row that has seen nothing yet keeps max -inf; shift by 0 there so exp gives 0, not NaN.
      shift = jnp.where(jnp.isneginf(new_max), 0.0, new_max)
      p_BKRS = jnp.exp(s_BKRS - shift[..., None])
      rescale = jnp.exp(max_BKR - shift)
      den_BKR = den_BKR * rescale + jnp.sum(p_BKRS, axis=-1)
      pv_BKRH = jnp.einsum("bkrs,bksh->bkrh", p_BKRS.astype(v_BKSH.dtype), v_BKSH, preferred_element_type=_F32)
      return acc_BKRH * rescale[..., None] + pv_BKRH, new_max, den_BKR

    def q_block(i, state):
      # Scaling each q block once saves a pass over every score tile.
      q_BKRH = (_q_tile(q_BTNH, i * bq, bq, K, heads) * H**-0.5).astype(q_BTNH.dtype)
      acc, mx, den = state
      carry = _q_tile(acc, i * bq, bq, K), _row_tile(mx, i * bq, bq, K), _row_tile(den, i * bq, bq, K)
      # The switch carries one tile's state only: a switch over the whole state would copy it.
      carry = jax.lax.fori_loop(0, S // bk, lambda j, c: jax.lax.switch(kind_QS[i, j], [
          lambda c: c, functools.partial(tile, i, j, True, q_BKRH), functools.partial(tile, i, j, False, q_BKRH)],
          c), carry)
      return (jax.lax.dynamic_update_slice_in_dim(acc, _unrows(carry[0], bq), i * bq, axis=1),
              *(jax.lax.dynamic_update_slice_in_dim(full, _unrow_tile(part, bq), i * bq, axis=2)
                for full, part in zip((mx, den), carry[1:])))

    with jax.named_scope("blockwise_fwd"):
      return jax.lax.fori_loop(0, _trips(skip_QS, T // bq), q_block, state)

  def finish(self, state, dtype):
    """(out [B, T, N, H] in `dtype`, lse [B, N, T]). Rows that saw no key give zeros and lse -inf."""
    acc_BTNH, max_BNT, den_BNT = state
    empty = den_BNT == 0
    out_BTNH = acc_BTNH / jnp.swapaxes(jnp.where(empty, 1.0, den_BNT), 1, 2)[..., None]
    lse_BNT = jnp.where(empty, -jnp.inf, max_BNT + jnp.log(jnp.where(empty, 1.0, den_BNT)))
    return out_BTNH.astype(dtype), lse_BNT

  @staticmethod
  def delta(out_BTNH, dout_BTNH):
    """rowsum(dO ∘ O), [B, N, T] like lse: the softmax backward's correction term."""
    return jnp.swapaxes(jnp.sum(out_BTNH.astype(_F32) * dout_BTNH.astype(_F32), axis=-1), 1, 2)

  def backward(self, q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, lse_BNT, delta_BNT, dout_BTNH,
               grads=None, first_head=None):
    """float32 (dq, dk, dv) of this chunk of keys, given the final lse and delta of the queries, added to `grads`
    (float32 accumulators shaped like dq, k, v, updated in place) when given. dq has lse's N heads: with
    `first_head`, q, dout and delta may hold more, and the pass reads their [first_head, first_head + N)."""
    q_BTNH, k_BSKH, v_BSKH, dout_BTNH = self._cast(q_BTNH, k_BSKH, v_BSKH, dout_BTNH)
    B, T, _, H = q_BTNH.shape
    N = lse_BNT.shape[1]
    heads = None if first_head is None else (first_head, N)
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    G = N // K
    bq, bk = self._blocks(T, S)
    # With q scaled, ds · (scaled q) is dk already and only the dq tile needs the scale.
    scale = H**-0.5
    # A row that saw nothing has lse -inf and every score masked: shift by 0 so exp gives 0.
    lse_BNT = jnp.where(jnp.isneginf(lse_BNT), 0.0, lse_BNT)
    skip_QS, kind_QS = _tile_kinds(q_seg, kv_seg, q_pos, kv_pos, bq, bk)

    def tile(i, j, masked, k_BKSH, v_BKSH):
      q_BKRH = (_q_tile(q_BTNH, i * bq, bq, K, heads) * scale).astype(q_BTNH.dtype)
      do_BKRH = _q_tile(dout_BTNH, i * bq, bq, K, heads)
      lse_BKR, delta_BKR = _row_tile(lse_BNT, i * bq, bq, K), _row_tile(delta_BNT, i * bq, bq, K, heads)
      # Scores transposed ([keys, rows]): then dv and dk are plain products and only dq contracts over keys.
      s_BKSR = jnp.einsum("bksh,bkrh->bksr", k_BKSH, q_BKRH, preferred_element_type=_F32)
      p_BKSR = jnp.exp(s_BKSR - lse_BKR[:, :, None])
      if masked:
        vis_BQS = _tile_mask(q_seg, kv_seg, q_pos, kv_pos, i * bq, j * bk, bq, bk)
        p_BKSR = jnp.where(jnp.swapaxes(_rows_mask(vis_BQS, G), 2, 3), p_BKSR, 0.0)
      dv_BKSH = jnp.einsum("bksr,bkrh->bksh", p_BKSR.astype(do_BKRH.dtype), do_BKRH, preferred_element_type=_F32)
      dp_BKSR = jnp.einsum("bksh,bkrh->bksr", v_BKSH, do_BKRH, preferred_element_type=_F32)
      ds_BKSR = (p_BKSR * (dp_BKSR - delta_BKR[:, :, None])).astype(q_BKRH.dtype)
      dk_BKSH = jnp.einsum("bksr,bkrh->bksh", ds_BKSR, q_BKRH, preferred_element_type=_F32)
      dq_BKRH = jnp.einsum("bksr,bksh->bkrh", ds_BKSR, k_BKSH, preferred_element_type=_F32) * scale
      return _unrows(dq_BKRH, bq), dk_BKSH, dv_BKSH

    def q_block(j, k_BKSH, v_BKSH, i, carry):
      dq_BTNH, dk_BKSH, dv_BKSH = carry
      # The switch yields one tile's gradients; the accumulators stay outside it so nothing large is copied.
      zeros = (jnp.zeros((B, bq, N, H), _F32), jnp.zeros((B, K, bk, H), _F32), jnp.zeros((B, K, bk, H), _F32))
      dq_tile, dk_tile, dv_tile = jax.lax.switch(kind_QS[i, j], [
          lambda: zeros, functools.partial(tile, i, j, True, k_BKSH, v_BKSH),
          functools.partial(tile, i, j, False, k_BKSH, v_BKSH)])
      return _add_at(dq_BTNH, dq_tile, i * bq), dk_BKSH + dk_tile, dv_BKSH + dv_tile

    def kv_block(j, grads):
      dq_BTNH, dk_BSKH, dv_BSKH = grads
      k_BKSH, v_BKSH = _kv_tile(k_BSKH, j * bk, bk), _kv_tile(v_BSKH, j * bk, bk)
      zeros = jnp.zeros((B, K, bk, H), _F32)
      dq_BTNH, dk_BKSH, dv_BKSH = jax.lax.fori_loop(0, T // bq, functools.partial(q_block, j, k_BKSH, v_BKSH),
                                                    (dq_BTNH, zeros, zeros))
      return (dq_BTNH, _add_at(dk_BSKH, jnp.swapaxes(dk_BKSH, 1, 2), j * bk),
              _add_at(dv_BSKH, jnp.swapaxes(dv_BKSH, 1, 2), j * bk))

    with jax.named_scope("blockwise_bwd"):
      if grads is None:
        grads = (jnp.zeros((B, T, N, H), _F32), jnp.zeros((B, S, K, H), _F32), jnp.zeros((B, S, K, H), _F32))
      return jax.lax.fori_loop(0, _trips(skip_QS, S // bk), kv_block, grads)


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
    state = parts.forward(parts.init(q_BTNH), q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos)
    out_BTNH, lse = keep(*parts.finish(state, q_BTNH.dtype))
    return out_BTNH, (q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, out_BTNH, lse)

  def bwd(res, dout_BTNH):
    q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, out_BTNH, lse = res
    delta = parts.delta(out_BTNH, dout_BTNH)
    dq, dk, dv = parts.backward(q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, lse, delta, dout_BTNH)
    return dq.astype(q_BTNH.dtype), dk.astype(k_BSKH.dtype), dv.astype(v_BSKH.dtype), None, None, None, None

  attend.defvjp(fwd, bwd)
  return attend
