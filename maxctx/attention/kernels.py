"""Local attention kernels: attention of the queries a device holds against the keys/values it is given.

Every kernel takes q [B, Tq, N, H], k and v [B, Tk, K, H] (N a multiple of K: grouped-query attention), the
segment ids and positions of queries and keys, and returns out [B, Tq, N, H] in q's dtype, masked by
`mask.visible`. A query that sees no key (padding) gets zeros.

Kernels that can also run chunk by chunk (`Blockwise` pieces: init, forward, finish, backward) can sit under the
ring and USP, which feed them one chunk of keys per hop; the others serve all_gather and ulysses only.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from maxctx.attention import cudnn, flash, mask
from maxctx.attention.blockwise import Blockwise, attend_fn

Kernel = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class KernelSpec:
  """How to make a kernel for given block sizes, whether it runs chunk by chunk, and where it runs."""
  make: Callable[[int | None, int | None], Kernel]
  parts: Callable[[int | None, int | None], Blockwise] | None = None
  platforms: tuple[str, ...] | None = None   # None: every backend
  check: Callable[..., str | None] | None = None   # why it cannot run a `registry.Problem` (a sentence), or None


KERNELS: dict[str, KernelSpec] = {}


def register(name: str, spec: KernelSpec) -> None:
  KERNELS[name] = spec


def reference(q_BTNH, k_BSKH, v_BSKH, q_segment_ids, kv_segment_ids, q_positions, kv_positions):
  """Dense attention in float32: the oracle the other kernels and strategies are tested against. O(Tq·Tk) memory."""
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  q_BTKGH = q_BTNH.astype(jnp.float32).reshape(B, T, K, N // K, H)
  scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH.astype(jnp.float32)) * H**-0.5
  visible_BTS = mask.visible(q_segment_ids, kv_segment_ids, q_positions, kv_positions)
  scores_BKGTS = jnp.where(visible_BTS[:, None, None], scores_BKGTS, -jnp.inf)
  row_max = jnp.max(scores_BKGTS, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs_BKGTS = jnp.exp(scores_BKGTS - row_max)
  denom = jnp.sum(probs_BKGTS, axis=-1, keepdims=True)
  probs_BKGTS = probs_BKGTS / jnp.where(denom == 0, 1.0, denom)
  out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH.astype(jnp.float32))
  return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


# Under the ring the reference runs as one float32 tile per chunk pair: dense numerics, chunk-wise composition.
_WHOLE = 2**31 - 1
register("reference", KernelSpec(make=lambda bq, bk: reference,
                                 parts=lambda bq, bk: Blockwise(_WHOLE, _WHOLE, upcast=True)))
register("blockwise", KernelSpec(make=lambda bq, bk: attend_fn(Blockwise(bq, bk)),
                                 parts=lambda bq, bk: Blockwise(bq, bk)))
# flash serves every strategy on TPU and GPU; off them (tests) it runs in the Pallas interpreter, cudnn off the GPU
# through XLA, and validate refuses training with either there.
register("flash", KernelSpec(make=flash.make, parts=flash.parts, platforms=("tpu", "gpu"), check=flash.check))
register("cudnn", KernelSpec(make=cudnn.make, platforms=("gpu",)))


def get(name: str, block_q: int | None = None, block_kv: int | None = None) -> Kernel:
  """The kernel `name` with its block sizes bound (kernels without blocks ignore them)."""
  return KERNELS[name].make(block_q, block_kv)


def parts(name: str, block_q: int | None = None, block_kv: int | None = None) -> Blockwise:
  """The chunk-wise pieces of kernel `name`, for the ring and USP (validate refuses kernels without them)."""
  return KERNELS[name].parts(block_q, block_kv)
