"""What the flash kernels share: block sizes, the per-block mask summaries they skip tiles by, and moving per-token
values between the TPU's two vector orientations.

Layouts, chosen so that no array is transposed in HBM: q, the numerator and dq stay [B, T, N, H] and are read as
[B, T, N·H], so one block of `bq` tokens holds the G = N / K query heads of one KV head side by side in lanes
([bq, G·H], head g at lanes g·H); k, v, dk, dv are read as [B, S, K·H] in [bk, H] blocks. This needs H to be a
multiple of the 128 lanes. Per-(head, token) values (running max, denominator, lse, delta) stay [B, N, T] and are
read as [B, K, G, T] in [G, bq] blocks: one row of tokens in lanes per query head, the compact form.

A score tile is [bq, bk] (or its transpose), so a per-query value must be a column [bq, 1] to meet it, and a per-key
value a row [1, bk]. Rows come from HBM; `column` turns one into a column with one transpose on the XLU, done once
per block where the block stays in VMEM across the inner grid axis. Segment ids and positions travel as [B, 2, T]
int32: row 0 the segment id, row 1 the position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from maxctx.attention import mask

LANES = 128
DEFAULT_BLOCK = 512
FIELDS = 5   # a block's summary: lowest segment, its lowest position, highest segment, its highest position, padding
NT = (((1,), (1,)), ((), ()))   # contract the minor axes of both: a @ b.T without transposing b


def fit(block: int | None, length: int) -> int:
  """The largest multiple of 128 that is ≤ `block` (default 512, at least 128) and divides `length`."""
  for size in range(max(block or DEFAULT_BLOCK, LANES) // LANES * LANES, 0, -LANES):
    if length % size == 0:
      return size
  raise ValueError(f"the flash kernel needs a length that is a multiple of {LANES}, got {length}")


def ids_rows(segment_ids_BT, positions_BT):
  """[B, 2, T] int32: the segment ids in row 0, the positions in row 1 (see the module docstring)."""
  return jnp.stack([segment_ids_BT, positions_BT], axis=1).astype(jnp.int32)


def summaries(segment_ids_BT, positions_BT, block):
  """`mask.summarize` per block, flattened for SMEM (scalar prefetch): [FIELDS · B · T/block] int32, field-major.
  Field-major keeps the array lane-dense in HBM on its way there: [B, T/block, FIELDS] would pad its 5 to the TPU's
  128 lanes, 25 times the bytes."""
  fields = mask.summarize(segment_ids_BT, positions_BT, block)
  return jnp.stack([f.astype(jnp.int32) for f in fields]).reshape(-1)


def all_hidden(q_seg, kv_seg, q_pos, kv_pos, bq, bk):
  """Whether the mask hides every tile pair of the call, so it can be skipped whole (the ring's hidden hops)."""
  return jnp.all(mask.hidden(mask.summarize(q_seg, q_pos, bq), mask.summarize(kv_seg, kv_pos, bk)))


def tile_kind(q_sums, kv_sums, b, i, j, nq, nk):
  """(hidden, full) scalars for query block i and key block j of batch row b, from the SMEM summaries."""
  q_stride, kv_stride = q_sums.shape[0] // FIELDS, kv_sums.shape[0] // FIELDS   # B · blocks
  q = [q_sums[f * q_stride + b * nq + i] for f in range(FIELDS)]
  kv = [kv_sums[f * kv_stride + b * nk + j] for f in range(FIELDS)]
  q[4], kv[4] = q[4] != 0, kv[4] != 0
  return mask.pair_hidden(q, kv), mask.pair_full(q, kv)


def when_visible(hidden, full, tile) -> None:
  """Runs `tile(masked)` on a tile some of whose pairs are visible: unmasked where all are, masked where some are;
  a hidden tile does no work at all."""
  pl.when(full)(lambda: tile(False))
  pl.when(jnp.logical_not(hidden | full))(lambda: tile(True))


def query_blocks(q_sums, kv_sums, q_ref, k_ref, v_ref, q_ids_ref, kv_ids_ref, acc_in, acc_ref, q_seg_scr, q_pos_scr,
                 rows, groups, nq, nk, head) -> None:
  """The body of the kernels that keep a query block while key blocks pass (forward, dq; grid (b, kv head, i, j)).

  On the block's first visit: the float32 accumulator from its input block (an aliased output block starts
  undefined in VMEM), the block's ids as columns, and each (row input, column scratch) pair of per-row values
  ([groups, Q] → groups × [Q, LANES]). Then, for each query head g of a tile with visible pairs,
  `head(g, lanes, s_QS, vis_QS, k_SH, v_SH)` with the scaled scores and the mask (None where all pairs are visible).
  """
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  H = k_ref.shape[-1]

  @pl.when(j == 0)
  def _load():
    acc_ref[...] = acc_in[...]
    q_seg_scr[...], q_pos_scr[...] = id_columns(q_ids_ref)
    for rows_ref, columns_scr in rows:
      for g in range(groups):
        columns_scr[g] = column(rows_ref[g:g + 1, :])

  def tile(masked):
    k_SH, v_SH = k_ref[...], v_ref[...]
    vis_QS = visible(q_seg_scr[...], q_pos_scr[...], kv_ids_ref) if masked else None
    for g in range(groups):
      s_QS = jax.lax.dot_general(scaled_q(q_ref, g, H), k_SH, NT, preferred_element_type=jnp.float32)
      head(g, slice(g * H, (g + 1) * H), s_QS, vis_QS, k_SH, v_SH)

  when_visible(*tile_kind(q_sums, kv_sums, b, i, j, nq, nk), tile)


def scaled_q(q_ref, g, H):
  """Query head g of the block's [Q, groups·H] lanes, pre-scaled by H^-1/2 in its own dtype."""
  return (q_ref[:, g * H:(g + 1) * H] * H**-0.5).astype(q_ref.dtype)


def column(row_1Q):
  """[1, Q] -> [Q, LANES]: the row's values down the sublanes, repeated over lanes (one XLU transpose)."""
  return jnp.broadcast_to(row_1Q, (LANES, row_1Q.shape[1])).T


def row(column_QL):
  """[Q, LANES] with equal lanes -> [1, Q], the inverse of `column`."""
  return column_QL.T[0:1, :]


def id_columns(ids_ref):
  """(segment ids, positions) of a [2, Q] ids block as [Q, LANES] columns."""
  return column(ids_ref[0:1, :]), column(ids_ref[1:2, :])


def visible(q_seg_col, q_pos_col, kv_ids_ref):
  """The contract's mask of a [Q, bk] tile: query columns against the key block's id rows (`mask.visible`)."""
  q_seg, q_pos = q_seg_col[:, 0:1], q_pos_col[:, 0:1]
  kv_seg, kv_pos = kv_ids_ref[0:1, :], kv_ids_ref[1:2, :]
  return (q_seg == kv_seg) & (q_seg != 0) & (kv_pos <= q_pos)


def visible_t(kv_seg_col, kv_pos_col, q_ids_ref):
  """The transposed mask, [bk, Q]: key columns against the query block's id rows."""
  kv_seg, kv_pos = kv_seg_col[:, 0:1], kv_pos_col[:, 0:1]
  q_seg, q_pos = q_ids_ref[0:1, :], q_ids_ref[1:2, :]
  return (kv_seg == q_seg) & (q_seg != 0) & (kv_pos <= q_pos)


def heads_view(x_BTNH):
  """[B, T, N, H] -> [B, T, N·H] (free): blocks of [tokens, heads·H] lanes."""
  B, T, N, H = x_BTNH.shape
  return x_BTNH.reshape(B, T, N * H)


def rows_view(x_BNT, groups):
  """[B, N, T] -> [B, N/G, G, T] (free): one [G, tokens] block per KV head."""
  B, N, T = x_BNT.shape
  return x_BNT.reshape(B, N // groups, groups, T)


def dispatch(make_call, *operands, interpret: bool | None = None, platform: str = "tpu"):
  """`make_call(interpret)(*operands)`: compiled (Mosaic; Triton with platform="cuda") where the step is lowered for
  `platform`, the Pallas interpreter elsewhere. Chosen when lowering, not from the default backend, so an
  ahead-of-time TPU compile on a CPU host gets the real kernel (`lax.platform_dependent` lowers only the branch of the
  platform compiled for). `interpret` forces it."""
  if interpret is not None:
    return make_call(interpret)(*operands)
  return jax.lax.platform_dependent(*operands, default=make_call(True), **{platform: make_call(False)})


def check(x: jax.Array, what: str) -> None:
  if x.shape[-1] % LANES:
    raise ValueError(f"the flash kernel needs {what} to be a multiple of {LANES}, got {x.shape[-1]}")
