"""The flash backward kernels: float32 dq, and dk with dv, of one chunk of keys from the queries' final lse and
delta, recomputing each score tile instead of storing it (TPU, Mosaic).

Two kernels, so that each accumulates into a block that stays in VMEM along its inner, sequential grid axis:
  dq:  grid (b, KV head h, query block i, key block j), scores [bq, bk] as in the forward; lse and delta turned
       into columns once per query block.
  dkv: grid (b, h, key block j, query block i), scores transposed ([bk, bq]), so the per-query lse and delta are
       rows as they come from HBM and dv = pᵀ·do, dk = dsᵀ·q are plain products; the G query heads of the KV head
       add into the same dk, dv (GQA without repeating K/V).
Tiles are skipped or left unmasked from the scalar-prefetched block summaries, as in the forward. The gradients
given (`grads`) are aliased to the outputs and read at the first step of the inner axis: the ring's float32
accumulators are added to in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from maxctx.attention import flash_tiles as tiles

_F32 = jnp.float32
_GRID = ("parallel", "parallel", "parallel", "arbitrary")


def _dq_kernel(q_sums, kv_sums, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_ids_ref, kv_ids_ref,
               dq_in, dq_ref, q_seg_scr, q_pos_scr, lse_scr, delta_scr, *, groups, nq, nk):
  H = k_ref.shape[-1]

  def head(g, lanes, s_QS, vis_QS, k_SH, v_SH):
    p_QS = jnp.exp(s_QS - lse_scr[g][:, 0:1])
    if vis_QS is not None:
      p_QS = jnp.where(vis_QS, p_QS, 0.0)
    dp_QS = jax.lax.dot_general(do_ref[:, lanes], v_SH, tiles.NT, preferred_element_type=_F32)
    ds_QS = (p_QS * (dp_QS - delta_scr[g][:, 0:1])).astype(k_SH.dtype)
    dq_ref[:, lanes] += jnp.dot(ds_QS, k_SH, preferred_element_type=_F32) * H**-0.5

  tiles.query_blocks(q_sums, kv_sums, q_ref, k_ref, v_ref, q_ids_ref, kv_ids_ref, dq_in, dq_ref, q_seg_scr,
                     q_pos_scr, ((lse_ref, lse_scr), (delta_ref, delta_scr)), groups, nq, nk, head)


def _dkv_kernel(q_sums, kv_sums, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_ids_ref, kv_ids_ref,
                dk_in, dv_in, dk_ref, dv_ref, kv_seg_scr, kv_pos_scr, *, groups, nq, nk):
  b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  H = k_ref.shape[-1]

  @pl.when(i == 0)
  def _load():
    dk_ref[...], dv_ref[...] = dk_in[...], dv_in[...]
    kv_seg_scr[...], kv_pos_scr[...] = tiles.id_columns(kv_ids_ref)

  hidden, full = tiles.tile_kind(q_sums, kv_sums, b, i, j, nq, nk)

  def tile(masked):
    k_SH, v_SH = k_ref[...], v_ref[...]
    vis_SQ = tiles.visible_t(kv_seg_scr[...], kv_pos_scr[...], q_ids_ref) if masked else None
    dk_SH, dv_SH = dk_ref[...], dv_ref[...]
    for g in range(groups):
      lanes = slice(g * H, (g + 1) * H)
      q_QH = tiles.scaled_q(q_ref, g, H)
      do_QH = do_ref[:, lanes]
      s_SQ = jax.lax.dot_general(k_SH, q_QH, tiles.NT, preferred_element_type=_F32)
      p_SQ = jnp.exp(s_SQ - lse_ref[g:g + 1, :])
      if masked:
        p_SQ = jnp.where(vis_SQ, p_SQ, 0.0)
      dv_SH += jnp.dot(p_SQ.astype(do_QH.dtype), do_QH, preferred_element_type=_F32)
      dp_SQ = jax.lax.dot_general(v_SH, do_QH, tiles.NT, preferred_element_type=_F32)
      ds_SQ = (p_SQ * (dp_SQ - delta_ref[g:g + 1, :])).astype(q_QH.dtype)
      # With q scaled, dsᵀ · (scaled q) is dk already.
      dk_SH += jnp.dot(ds_SQ, q_QH, preferred_element_type=_F32)
    dk_ref[...], dv_ref[...] = dk_SH, dv_SH

  tiles.when_visible(hidden, full, tile)


def backward(grads, q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, lse_BNT, delta_BNT, dout_BTNH, bq, bk,
             interpret):
  """`grads` (float32 dq [B, T, N, H], dk and dv [B, S, K, H]) plus this chunk's; q, dout, lse and delta have the
  same N heads. `interpret` as in `flash_fwd.forward`."""
  B, N, T = lse_BNT.shape
  S, K, H = k_BSKH.shape[1:]
  G = N // K
  nq, nk = T // bq, S // bk
  tiles.check(q_BTNH, "the head dim")
  # A row that saw nothing has lse -inf and every score masked: shift by 0 so exp gives 0.
  lse_BNT = jnp.where(jnp.isneginf(lse_BNT), 0.0, lse_BNT)

  def specs(order):
    """in_specs of q, k, v, do, lse, delta, query ids and key ids; `order` maps the grid's indices to (b, h, i, j).
    Index maps get the scalar-prefetch refs after the grid indices."""
    def at(block):
      return lambda *idx: block(*order(*idx[:4]))

    q_spec = pl.BlockSpec((None, bq, G * H), at(lambda b, h, i, j: (b, i, h)))
    kv_spec = pl.BlockSpec((None, bk, H), at(lambda b, h, i, j: (b, j, h)))
    rows_spec = pl.BlockSpec((None, None, G, bq), at(lambda b, h, i, j: (b, h, 0, i)))
    return [q_spec, kv_spec, kv_spec, q_spec, rows_spec, rows_spec,
            pl.BlockSpec((None, 2, bq), at(lambda b, h, i, j: (b, 0, i))),
            pl.BlockSpec((None, 2, bk), at(lambda b, h, i, j: (b, 0, j)))]

  dq_order = lambda b, h, i, j: (b, h, i, j)  # noqa: E731
  dkv_order = lambda b, h, j, i: (b, h, i, j)  # noqa: E731
  dq_spec = pl.BlockSpec((None, bq, G * H), lambda b, h, i, j, *_: (b, i, h))
  dkv_spec = pl.BlockSpec((None, bk, H), lambda b, h, j, i, *_: (b, j, h))
  # The forward stacks the same ids (`ids_rows`): without the barrier XLA computes each copy once for both, and it
  # stays live from the forward through all that runs before this backward (the queries' 14 MiB per device at the
  # peak of the 14M usp v5p step, in the MLP's backward). Keys too: whole-sequence attention has the queries' ids.
  q_seg, q_pos, kv_seg, kv_pos = jax.lax.optimization_barrier((q_seg, q_pos, kv_seg, kv_pos))
  ids = (tiles.summaries(q_seg, q_pos, bq), tiles.summaries(kv_seg, kv_pos, bk))
  operands = (tiles.heads_view(q_BTNH), tiles.heads_view(k_BSKH), tiles.heads_view(v_BSKH),
              tiles.heads_view(dout_BTNH), tiles.rows_view(lse_BNT, G), tiles.rows_view(delta_BNT, G),
              tiles.ids_rows(q_seg, q_pos), tiles.ids_rows(kv_seg, kv_pos))
  columns = [pltpu.VMEM((bq, tiles.LANES), jnp.int32)] * 2
  params = pltpu.CompilerParams(dimension_semantics=_GRID)

  dq_call = lambda interpret: pl.pallas_call(  # noqa: E731
      functools.partial(_dq_kernel, groups=G, nq=nq, nk=nk),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(B, K, nq, nk), in_specs=specs(dq_order) + [dq_spec], out_specs=dq_spec,
          scratch_shapes=columns + [pltpu.VMEM((G, bq, tiles.LANES), _F32)] * 2),
      out_shape=jax.ShapeDtypeStruct((B, T, N * H), _F32),
      input_output_aliases={10: 0}, compiler_params=params, interpret=interpret, name="maxctx_flash_dq")
  dkv_call = lambda interpret: pl.pallas_call(  # noqa: E731
      functools.partial(_dkv_kernel, groups=G, nq=nq, nk=nk),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(B, K, nk, nq), in_specs=specs(dkv_order) + [dkv_spec] * 2,
          out_specs=[dkv_spec] * 2, scratch_shapes=[pltpu.VMEM((bk, tiles.LANES), jnp.int32)] * 2),
      out_shape=[jax.ShapeDtypeStruct((B, S, K * H), _F32)] * 2,
      input_output_aliases={10: 0, 11: 1}, compiler_params=params, interpret=interpret, name="maxctx_flash_dkv")

  def run(grads):
    dq, dk, dv = grads
    dq = tiles.dispatch(dq_call, *ids, *operands, tiles.heads_view(dq), interpret=interpret)
    dk, dv = tiles.dispatch(dkv_call, *ids, *operands, tiles.heads_view(dk), tiles.heads_view(dv),
                            interpret=interpret)
    return dq.reshape(B, T, N, H), dk.reshape(B, S, K, H), dv.reshape(B, S, K, H)

  with jax.named_scope("flash_bwd"):
    return jax.lax.cond(tiles.all_hidden(q_seg, kv_seg, q_pos, kv_pos, bq, bk), lambda g: g, run, grads)
