"""The flash kernels for NVIDIA GPUs (Pallas, Triton lowering): the TPU kernels' chunk pieces with the same state,
inputs and mask, tiled for a GPU's streaming multiprocessors.

    forward:  grid (query block i, batch row b, query head n). The block's bq queries and its float32 state stay in
              registers while a loop runs over key blocks of KV head n // G; K and V are read in place from
              [B, S, K, H], so the G query heads of a KV head share them without a copy (GQA).
    dq:       the forward's grid and loop; dq accumulates in registers.
    dkv:      grid (key block j, b, KV head h). The block's float32 dk and dv accumulate in registers while one loop
              runs over the G query heads of h and the query blocks, so no two programs write the same rows (no
              atomics).

Layouts are the callers' (`flash`): q, the numerator, dq and dout [B, T, N, H]; k, v, dk, dv [B, S, K, H]; running
max, denominator, lse and delta [B, N, T]; segment ids and positions [B, T] int32. Each loop runs only over the
range of blocks that the block summaries (`mask.summarize`, `mask.pair_hidden`) do not hide, computed before the
call (`block_ranges`): its bounds are plain loop bounds, with no branch inside, so Triton can pipeline the loads of
the next tile under this one's products (causal attention does half the tiles; a packed document its own triangle,
plus, under zigzag, the hidden blocks between its two halves). Inside the range every tile is masked from the ids:
a few comparisons per score against the 2·H multiply-adds of each product. Blocks are powers of two of at least 16
(Triton's tiles) that divide the lengths; `fit` picks them.

The given state and gradients are aliased to the outputs: the ring's float32 accumulators are updated in place.
`flash` uses these kernels where JAX's default backend is a GPU (the TPU has its own: flash_fwd, flash_bwd); lowered
for anything but CUDA they run in the Pallas interpreter (tests). jax 0.12 marks Pallas's Triton lowering deprecated
in favour of Mosaic GPU; it is the lowering both the GPU machines' jax (0.11) and ours have, so these kernels use it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from maxctx.attention import flash_tiles as tiles
from maxctx.attention import mask

_F32 = jnp.float32
MIN_BLOCK = 16            # Triton's smallest matrix-product tile side
FWD_BLOCKS = (128, 64)    # (queries, keys) per forward tile; the backward's tiles hold more live values
BWD_BLOCKS = (64, 64)
_WARPS = {"fwd": 8, "bwd": 8}
_STAGES = 2


def fit(block: int | None, default: int, length: int) -> int:
  """The largest power of two that is ≤ `block` (else `default`), at least `MIN_BLOCK`, and divides `length`."""
  size = max(MIN_BLOCK, 1 << (max(block or default, MIN_BLOCK).bit_length() - 1))
  while size > MIN_BLOCK and length % size:
    size //= 2
  if length % size:
    raise ValueError(f"the GPU flash kernel needs a length that is a multiple of {MIN_BLOCK}, got {length}")
  return size


def _nt(a, b):
  """a @ b.T in float32, without moving b."""
  return jax.lax.dot_general(a, b, tiles.NT, preferred_element_type=_F32)


def _visible(q_seg, q_pos, kv_seg, kv_pos):
  """The contract's mask of a [bq, bk] tile from the queries' and keys' id vectors (`mask.visible`)."""
  return (q_seg[:, None] == kv_seg[None, :]) & (q_seg[:, None] != 0) & (kv_pos[None, :] <= q_pos[:, None])


def _scaled(q):
  return (q * q.shape[-1]**-0.5).astype(q.dtype)


def block_ranges(q_seg, kv_seg, q_pos, kv_pos, bq, bk):
  """The loops' bounds: per query block, the first and one-past-the-last key block the mask does not hide
  (`mask.pair_hidden` on the block summaries), and per key block the same over query blocks; four [B · blocks] int32
  vectors (q_lo, q_hi, kv_lo, kv_hi). A block that sees nothing gets an empty range."""
  q_sums, kv_sums = mask.summarize(q_seg, q_pos, bq), mask.summarize(kv_seg, kv_pos, bk)
  seen = ~mask.pair_hidden([x[:, :, None] for x in q_sums], [x[:, None, :] for x in kv_sums])   # [B, nq, nk]
  nq, nk = seen.shape[1:]
  i, j = jnp.arange(nq)[:, None], jnp.arange(nk)[None, :]
  q_lo, q_hi = jnp.min(jnp.where(seen, j, nk), axis=2), jnp.max(jnp.where(seen, j + 1, 0), axis=2)
  kv_lo, kv_hi = jnp.min(jnp.where(seen, i, nq), axis=1), jnp.max(jnp.where(seen, i + 1, 0), axis=1)
  return tuple(x.reshape(-1).astype(jnp.int32) for x in (q_lo, jnp.maximum(q_hi, q_lo), kv_lo,
                                                           jnp.maximum(kv_hi, kv_lo)))


def _fwd_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, q_seg_ref, q_pos_ref, kv_seg_ref, kv_pos_ref,
                acc_in, max_in, den_in, acc_ref, max_ref, den_ref, *, bk, nq):
  at = pl.program_id(1) * nq + pl.program_id(0)
  q_QH = _scaled(q_ref[...])
  q_seg, q_pos = q_seg_ref[...], q_pos_ref[...]

  def step(j, carry):
    acc_QH, max_Q, den_Q = carry
    keys = pl.ds(j * bk, bk)
    v_SH = v_ref[keys, :]
    s_QS = _nt(q_QH, k_ref[keys, :])
    s_QS = jnp.where(_visible(q_seg, q_pos, kv_seg_ref[keys], kv_pos_ref[keys]), s_QS, -jnp.inf)
    max_new = jnp.maximum(max_Q, jnp.max(s_QS, axis=1))
    # A row that has seen nothing keeps max -inf; shift by 0 there so exp gives 0, not NaN.
    shift = jnp.where(max_new == -jnp.inf, 0.0, max_new)
    p_QS = jnp.exp(s_QS - shift[:, None])
    rescale = jnp.exp(max_Q - shift)
    acc_QH = acc_QH * rescale[:, None] + jnp.dot(p_QS.astype(v_SH.dtype), v_SH, preferred_element_type=_F32)
    return acc_QH, max_new, den_Q * rescale + jnp.sum(p_QS, axis=1)

  acc_ref[...], max_ref[...], den_ref[...] = jax.lax.fori_loop(lo_ref[at], hi_ref[at], step,
                                                               (acc_in[...], max_in[...], den_in[...]))


def _dq_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, q_pos_ref, kv_seg_ref,
               kv_pos_ref, dq_in, dq_ref, *, bk, nq):
  at = pl.program_id(1) * nq + pl.program_id(0)
  q_QH, do_QH = _scaled(q_ref[...]), do_ref[...]
  # A row that saw nothing has lse -inf and every score masked: shift by 0 so exp gives 0.
  lse_Q = jnp.where(lse_ref[...] == -jnp.inf, 0.0, lse_ref[...])
  delta_Q = delta_ref[...]
  q_seg, q_pos = q_seg_ref[...], q_pos_ref[...]
  H = q_QH.shape[-1]

  def step(j, dq_QH):
    keys = pl.ds(j * bk, bk)
    k_SH, v_SH = k_ref[keys, :], v_ref[keys, :]
    p_QS = jnp.exp(_nt(q_QH, k_SH) - lse_Q[:, None])
    p_QS = jnp.where(_visible(q_seg, q_pos, kv_seg_ref[keys], kv_pos_ref[keys]), p_QS, 0.0)
    ds_QS = (p_QS * (_nt(do_QH, v_SH) - delta_Q[:, None])).astype(k_SH.dtype)
    return dq_QH + jnp.dot(ds_QS, k_SH, preferred_element_type=_F32) * H**-0.5

  dq_ref[...] = jax.lax.fori_loop(lo_ref[at], hi_ref[at], step, dq_in[...])


def _dkv_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, q_pos_ref, kv_seg_ref,
                kv_pos_ref, dk_in, dv_in, dk_ref, dv_ref, *, bq, nk, groups):
  at = pl.program_id(1) * nk + pl.program_id(0)
  lo, n = lo_ref[at], hi_ref[at] - lo_ref[at]
  k_SH, v_SH = k_ref[...], v_ref[...]
  kv_seg, kv_pos = kv_seg_ref[...], kv_pos_ref[...]

  def step(t, carry):
    dk_SH, dv_SH = carry
    # One loop over the G query heads × the range's query blocks (lax's div and rem: jnp's floor forms do not lower
    # to Triton); a key block whose range is empty runs none.
    g, rows = jax.lax.div(t, n), pl.ds((lo + jax.lax.rem(t, n)) * bq, bq)
    q_QH, do_QH = _scaled(q_ref[rows, g, :]), do_ref[rows, g, :]
    lse_Q = lse_ref[g, rows]
    lse_Q = jnp.where(lse_Q == -jnp.inf, 0.0, lse_Q)
    p_SQ = jnp.exp(_nt(k_SH, q_QH) - lse_Q[None, :])
    p_SQ = jnp.where(_visible(q_seg_ref[rows], q_pos_ref[rows], kv_seg, kv_pos).T, p_SQ, 0.0)
    dv_SH = dv_SH + jnp.dot(p_SQ.astype(do_QH.dtype), do_QH, preferred_element_type=_F32)
    ds_SQ = (p_SQ * (_nt(v_SH, do_QH) - delta_ref[g, rows][None, :])).astype(q_QH.dtype)
    # With q scaled, dsᵀ · (scaled q) is dk already.
    return dk_SH + jnp.dot(ds_SQ, q_QH, preferred_element_type=_F32), dv_SH

  dk_ref[...], dv_ref[...] = jax.lax.fori_loop(0, groups * n, step, (dk_in[...], dv_in[...]))


def _whole(x):
  return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def forward(state, q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, bq, bk, interpret):
  """The state (numerator [B, T, N, H], max and denominator [B, N, T], float32) after this chunk of keys."""
  acc_BTNH = state[0]
  B, T, N, H = acc_BTNH.shape
  S, K = k_BSKH.shape[1:3]
  G, nq = N // K, T // bq
  q_lo, q_hi, _, _ = block_ranges(q_seg, kv_seg, q_pos, kv_pos, bq, bk)
  ids = tuple(x.astype(jnp.int32) for x in (q_seg, q_pos, kv_seg, kv_pos))
  q_spec = pl.BlockSpec((None, bq, None, H), lambda i, b, n: (b, i, n, 0))
  kv_spec = pl.BlockSpec((None, S, None, H), lambda i, b, n: (b, 0, jax.lax.div(n, G), 0))
  row_spec = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))
  q_ids = pl.BlockSpec((None, bq), lambda i, b, n: (b, i))
  kv_ids = pl.BlockSpec((None, S), lambda i, b, n: (b, 0))
  call = lambda interpret: pl.pallas_call(  # noqa: E731
      functools.partial(_fwd_kernel, bk=bk, nq=nq), grid=(nq, B, N),
      in_specs=[_whole(q_lo), _whole(q_hi), q_spec, kv_spec, kv_spec, q_ids, q_ids, kv_ids, kv_ids,
                q_spec, row_spec, row_spec],
      out_specs=[q_spec, row_spec, row_spec],
      out_shape=[jax.ShapeDtypeStruct(x.shape, _F32) for x in state],
      input_output_aliases={9: 0, 10: 1, 11: 2},
      compiler_params=pltriton.CompilerParams(num_warps=_WARPS["fwd"], num_stages=_STAGES),
      interpret=interpret, name="maxctx_flash_gpu_fwd")
  run = lambda state: tuple(tiles.dispatch(  # noqa: E731
      call, q_lo, q_hi, q_BTNH, k_BSKH, v_BSKH, *ids, *state, interpret=interpret, platform="cuda"))
  # A chunk the mask hides whole (a ring hop before the queries' documents start) costs no kernel launch.
  with jax.named_scope("flash_fwd"):
    return jax.lax.cond(jnp.all(q_hi <= q_lo), lambda state: state, run, state)


def backward(grads, q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, lse_BNT, delta_BNT, dout_BTNH, bq, bk,
             interpret):
  """`grads` (float32 dq [B, T, N, H], dk and dv [B, S, K, H]) plus this chunk's; q, dout, lse and delta have the
  same N heads."""
  B, N, T = lse_BNT.shape
  S, K, H = k_BSKH.shape[1:]
  G, nq, nk = N // K, T // bq, S // bk
  q_lo, q_hi, kv_lo, kv_hi = block_ranges(q_seg, kv_seg, q_pos, kv_pos, bq, bk)
  operands = (q_BTNH, k_BSKH, v_BSKH, dout_BTNH, lse_BNT, delta_BNT,
              *(x.astype(jnp.int32) for x in (q_seg, q_pos, kv_seg, kv_pos)))
  params = pltriton.CompilerParams(num_warps=_WARPS["bwd"], num_stages=_STAGES)

  # dq: the forward's grid, (i, b, n).
  q_spec = pl.BlockSpec((None, bq, None, H), lambda i, b, n: (b, i, n, 0))
  kv_spec = pl.BlockSpec((None, S, None, H), lambda i, b, n: (b, 0, jax.lax.div(n, G), 0))
  row_spec = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))
  q_ids, kv_ids = pl.BlockSpec((None, bq), lambda i, b, n: (b, i)), pl.BlockSpec((None, S), lambda i, b, n: (b, 0))
  dq_call = lambda interpret: pl.pallas_call(  # noqa: E731
      functools.partial(_dq_kernel, bk=bk, nq=nq), grid=(nq, B, N),
      in_specs=[_whole(q_lo), _whole(q_hi), q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec,
                q_ids, q_ids, kv_ids, kv_ids, q_spec],
      out_specs=q_spec, out_shape=jax.ShapeDtypeStruct((B, T, N, H), _F32), input_output_aliases={12: 0},
      compiler_params=params, interpret=interpret, name="maxctx_flash_gpu_dq")

  # dkv: grid (j, b, h); a program reads all T queries of its G heads and keeps its key block.
  group_spec = pl.BlockSpec((None, T, G, H), lambda j, b, h: (b, 0, h, 0))
  key_spec = pl.BlockSpec((None, bk, None, H), lambda j, b, h: (b, j, h, 0))
  rows_spec = pl.BlockSpec((None, G, T), lambda j, b, h: (b, h, 0))
  all_q_ids, key_ids = pl.BlockSpec((None, T), lambda j, b, h: (b, 0)), pl.BlockSpec((None, bk), lambda j, b, h: (b, j))
  dkv_call = lambda interpret: pl.pallas_call(  # noqa: E731
      functools.partial(_dkv_kernel, bq=bq, nk=nk, groups=G), grid=(nk, B, K),
      in_specs=[_whole(kv_lo), _whole(kv_hi), group_spec, key_spec, key_spec, group_spec, rows_spec, rows_spec,
                all_q_ids, all_q_ids, key_ids, key_ids, key_spec, key_spec],
      out_specs=[key_spec, key_spec], out_shape=[jax.ShapeDtypeStruct((B, S, K, H), _F32)] * 2,
      input_output_aliases={12: 0, 13: 1}, compiler_params=params, interpret=interpret,
      name="maxctx_flash_gpu_dkv")

  def run(grads):
    dq, dk, dv = grads
    dq = tiles.dispatch(dq_call, q_lo, q_hi, *operands, dq, interpret=interpret, platform="cuda")
    dk, dv = tiles.dispatch(dkv_call, kv_lo, kv_hi, *operands, dk, dv, interpret=interpret, platform="cuda")
    return dq, dk, dv

  with jax.named_scope("flash_bwd"):
    return jax.lax.cond(jnp.all(q_hi <= q_lo), lambda grads: grads, run, grads)
