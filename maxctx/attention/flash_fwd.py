"""The flash forward kernel: one chunk of keys folded into the float32 online-softmax state, on the TPU (Mosaic).

Grid (batch row b, KV head h, query block i, key block j), j innermost and sequential. The state's blocks for
(b, h, i) stay in VMEM while j runs: the numerator directly in its output block, the running max and denominator as
[bq, LANES] columns in scratch (loaded from the carried [G, bq] rows at j = 0, written back at the last j). Each
tile first asks the scalar-prefetched block summaries whether the mask hides it (no MXU work), shows it whole (no
mask built) or cuts it (the mask from the ids in VMEM). The G query heads of the KV head are G matrix products
against the same [bk, H] key block, so K/V are read once per group and never repeated in HBM (GQA).

The state is aliased input to output, so the ring's carried state is updated in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from maxctx.attention import flash_tiles as tiles

_F32 = jnp.float32


def _kernel(q_sums, kv_sums, q_ref, k_ref, v_ref, q_ids_ref, kv_ids_ref, acc_in, max_in, den_in,
            acc_ref, max_ref, den_ref, q_seg_scr, q_pos_scr, max_scr, den_scr, *, groups, nq, nk):

  def head(g, lanes, s_QS, vis_QS, k_SH, v_SH):
    if vis_QS is not None:
      s_QS = jnp.where(vis_QS, s_QS, -jnp.inf)
    max_prev = max_scr[g][:, 0:1]
    max_new = jnp.maximum(max_prev, jnp.max(s_QS, axis=1, keepdims=True))
    # A row that has seen nothing keeps max -inf; shift by 0 there so exp gives 0, not NaN.
    shift = jnp.where(max_new == -jnp.inf, 0.0, max_new)
    p_QS = jnp.exp(s_QS - shift)
    rescale = jnp.exp(max_prev - shift)
    den_new = den_scr[g][:, 0:1] * rescale + jnp.sum(p_QS, axis=1, keepdims=True)
    max_scr[g] = jnp.broadcast_to(max_new, max_scr.shape[1:])
    den_scr[g] = jnp.broadcast_to(den_new, den_scr.shape[1:])
    pv_QH = jnp.dot(p_QS.astype(v_SH.dtype), v_SH, preferred_element_type=_F32)
    acc_ref[:, lanes] = acc_ref[:, lanes] * rescale + pv_QH

  tiles.query_blocks(q_sums, kv_sums, q_ref, k_ref, v_ref, q_ids_ref, kv_ids_ref, acc_in, acc_ref, q_seg_scr,
                     q_pos_scr, ((max_in, max_scr), (den_in, den_scr)), groups, nq, nk, head)

  @pl.when(pl.program_id(3) == nk - 1)
  def _store():
    for g in range(groups):
      max_ref[g:g + 1, :] = tiles.row(max_scr[g])
      den_ref[g:g + 1, :] = tiles.row(den_scr[g])


def forward(state, q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, bq, bk, interpret):
  """The state (numerator [B, T, N, H], max and denominator [B, N, T], float32) after this chunk of keys (q has the
  state's N heads). `interpret`: None picks Mosaic or the interpreter by the platform lowered for
  (`flash_tiles.dispatch`)."""
  acc_BTNH, max_BNT, den_BNT = state
  B, T, N, H = acc_BTNH.shape
  S, K = k_BSKH.shape[1:3]
  G = N // K
  nq, nk = T // bq, S // bk
  tiles.check(q_BTNH, "the head dim")

  specs = [
      pl.BlockSpec((None, bq, G * H), lambda b, h, i, j, *_: (b, i, h)),
      pl.BlockSpec((None, bk, H), lambda b, h, i, j, *_: (b, j, h)),
      pl.BlockSpec((None, bk, H), lambda b, h, i, j, *_: (b, j, h)),
      pl.BlockSpec((None, 2, bq), lambda b, h, i, j, *_: (b, 0, i)),
      pl.BlockSpec((None, 2, bk), lambda b, h, i, j, *_: (b, 0, j)),
  ]
  state_specs = [
      pl.BlockSpec((None, bq, G * H), lambda b, h, i, j, *_: (b, i, h)),
      pl.BlockSpec((None, None, G, bq), lambda b, h, i, j, *_: (b, h, 0, i)),
      pl.BlockSpec((None, None, G, bq), lambda b, h, i, j, *_: (b, h, 0, i)),
  ]
  make_call = lambda interpret: pl.pallas_call(  # noqa: E731
      functools.partial(_kernel, groups=G, nq=nq, nk=nk),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(B, K, nq, nk), in_specs=specs + state_specs, out_specs=state_specs,
          scratch_shapes=[pltpu.VMEM((bq, tiles.LANES), jnp.int32), pltpu.VMEM((bq, tiles.LANES), jnp.int32),
                          pltpu.VMEM((G, bq, tiles.LANES), _F32), pltpu.VMEM((G, bq, tiles.LANES), _F32)]),
      out_shape=[jax.ShapeDtypeStruct((B, T, N * H), _F32), *[jax.ShapeDtypeStruct((B, K, G, T), _F32)] * 2],
      # Operands count the two scalar-prefetch arrays: the state's three are 7, 8 and 9.
      input_output_aliases={7: 0, 8: 1, 9: 2},
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret, name="maxctx_flash_fwd")

  # The kernel's inputs are built outside the `cond` below, as in the backward: built inside a branch, they become
  # the conditional's own buffers, which XLA could not share (the backward of the 14M usp v5p step needed 1.8 GiB more
  # per device that way, this forward 14 MiB).
  operands = (tiles.summaries(q_seg, q_pos, bq), tiles.summaries(kv_seg, kv_pos, bk), tiles.heads_view(q_BTNH),
              tiles.heads_view(k_BSKH), tiles.heads_view(v_BSKH), tiles.ids_rows(q_seg, q_pos),
              tiles.ids_rows(kv_seg, kv_pos))

  def run(state):
    acc, mx, den = state
    views = tiles.heads_view(acc), tiles.rows_view(mx, G), tiles.rows_view(den, G)
    acc, mx, den = tiles.dispatch(make_call, *operands, *views, interpret=interpret)
    return acc.reshape(B, T, N, H), mx.reshape(B, N, T), den.reshape(B, N, T)

  # A chunk the mask hides whole (a ring hop before the queries' documents start) costs no kernel launch.
  with jax.named_scope("flash_fwd"):
    return jax.lax.cond(tiles.all_hidden(q_seg, kv_seg, q_pos, kv_pos, bq, bk), lambda s: s, run, state)
