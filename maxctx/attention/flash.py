"""flash: the fused TPU kernel (Pallas, Mosaic) with the contract's mask, in the chunk pieces the ring and USP call.

    state = init(q)                                   # numerator [B, T, N, H], max and denominator [B, N, T], f32
    state = forward(state, q, k, v, ...)              # flash_fwd: once per chunk of keys
    out, lse = finish(state, dtype)
    dq, dk, dv = backward(q, k, v, ..., lse, delta, do)   # flash_bwd: per chunk, float32, added to `grads`

The mask is read from segment ids and positions that are kernel inputs (ids in VMEM blocks, per-block summaries in
SMEM for skipping), never from a static mask, so the same compiled kernel is exact under zigzag, any permutation
and packed documents, under every strategy, and costs nothing on the host. The state has the blockwise kernel's
layout, so `finish` and `delta` are blockwise's. Block sizes are multiples of 128 (the TPU's lanes) fitted to each
call's lengths by `flash_tiles.fit`; head dims must be multiples of 128 too.

One name, two implementations with the same state, mask and pieces: the Mosaic kernels (flash_fwd, flash_bwd) for a
TPU and the Triton kernels (flash_gpu) for an NVIDIA GPU. Which set a step uses is decided when it is traced
(`KERNELS_FOR`); each set then compiles for its own platform when the step is lowered there and runs in the Pallas
interpreter when it is lowered for anything else (tests; validate refuses training there).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from maxctx.attention import flash_bwd, flash_fwd, flash_gpu
from maxctx.attention import flash_tiles as tiles
from maxctx.attention.blockwise import Blockwise, attend_fn

_F32 = jnp.float32
# Whose kernels a step uses: "tpu", "gpu", or None: the GPU's where JAX's default backend is a GPU, else the TPU's (an
# ahead-of-time TPU compile runs on a CPU host). Tests set "gpu" to run the GPU's in the interpreter.
KERNELS_FOR: str | None = None


def _for_gpu() -> bool:
  return (KERNELS_FOR or ("gpu" if jax.default_backend() == "gpu" else "tpu")) == "gpu"


@dataclasses.dataclass(frozen=True)
class Flash:
  """The flash pieces with their block sizes (None: 512, fitted down to a multiple of 128 dividing each length)."""
  block_q: int | None = None
  block_kv: int | None = None
  interpret: bool | None = None   # None: compiled when lowered for the kernels' platform, else the interpreter

  init = Blockwise.init
  finish = Blockwise.finish
  delta = staticmethod(Blockwise.delta)

  def fit_kv(self, length: int) -> int:
    """The key block this kernel uses for `length` keys (the ring cuts sub-chunks in whole blocks)."""
    return tiles.fit(self.block_kv, length)

  def forward(self, state, q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, first_head=None):
    """The state after one more chunk of keys; with `first_head`, the state's heads are q's [first_head, +N)."""
    q_BTNH = _pass_heads(q_BTNH, first_head, state[0].shape[2], axis=2)
    T, S = q_BTNH.shape[1], k_BSKH.shape[1]
    ids = (q_seg, kv_seg, q_pos, kv_pos)
    if _for_gpu():
      q_block, kv_block = flash_gpu.FWD_BLOCKS
      return flash_gpu.forward(state, q_BTNH, k_BSKH, v_BSKH, *ids, flash_gpu.fit(self.block_q, q_block, T),
                               flash_gpu.fit(self.block_kv, kv_block, S), self.interpret)
    return flash_fwd.forward(state, q_BTNH, k_BSKH, v_BSKH, *ids, tiles.fit(self.block_q, T), self.fit_kv(S),
                             self.interpret)

  def backward(self, q_BTNH, k_BSKH, v_BSKH, q_seg, kv_seg, q_pos, kv_pos, lse_BNT, delta_BNT, dout_BTNH,
               grads=None, first_head=None):
    """float32 (dq, dk, dv) of this chunk of keys added to `grads` (as in `Blockwise.backward`)."""
    B, T, _, H = q_BTNH.shape
    N = lse_BNT.shape[1]
    S, K = k_BSKH.shape[1:3]
    q_BTNH, dout_BTNH = (_pass_heads(x, first_head, N, axis=2) for x in (q_BTNH, dout_BTNH))
    delta_BNT = _pass_heads(delta_BNT, first_head, N, axis=1)
    if grads is None:
      grads = (jnp.zeros((B, T, N, H), _F32), jnp.zeros((B, S, K, H), _F32), jnp.zeros((B, S, K, H), _F32))
    ids = (q_seg, kv_seg, q_pos, kv_pos)
    if _for_gpu():
      q_block, kv_block = flash_gpu.BWD_BLOCKS
      return flash_gpu.backward(grads, q_BTNH, k_BSKH, v_BSKH, *ids, lse_BNT, delta_BNT, dout_BTNH,
                                flash_gpu.fit(self.block_q, q_block, T), flash_gpu.fit(self.block_kv, kv_block, S),
                                self.interpret)
    return flash_bwd.backward(grads, q_BTNH, k_BSKH, v_BSKH, *ids, lse_BNT, delta_BNT, dout_BTNH,
                              tiles.fit(self.block_q, T), self.fit_kv(S), self.interpret)


def _pass_heads(x, first_head, count, axis):
  """Heads [first_head, first_head + count) of x (all of x when first_head is None). The kernels read q and dout as
  [B, T, N·H], which on a TPU is a relayout of [B, T, N, H]: slicing the pass's heads first makes that copy one
  pass's heads, not all of them (a full copy of q and of dout cost 3.7 GiB per device in the 14M v5p ring recipe)."""
  return x if first_head is None else jax.lax.dynamic_slice_in_dim(x, first_head, count, axis=axis)


def make(block_q: int | None = None, block_kv: int | None = None):
  """Whole-sequence attention (all_gather, ulysses, no CP) through the same kernels, with their custom backward."""
  return attend_fn(parts(block_q, block_kv))


def parts(block_q: int | None = None, block_kv: int | None = None) -> Flash:
  return Flash(block_q, block_kv)


def check(p) -> str | None:
  """Why the flash kernel cannot run problem `p` on its platform (one sentence), or None. Both platforms need 128
  tokens per device at least (the ring cuts sub-chunks in the TPU's 128-token blocks, which the GPU's divide); the
  TPU's tiles need blocks and head dims in multiples of 128, Triton's tiles powers of two."""
  gpu = (p.platform or jax.default_backend()) == "gpu"
  for key, block in (("block_q", p.attention.block_q), ("block_kv", p.attention.block_kv)):
    if block is None:
      continue
    if gpu and (block < flash_gpu.MIN_BLOCK or block & (block - 1)):
      return (f"attention.{key} {block} is not a power of two of at least {flash_gpu.MIN_BLOCK}, which the flash "
              "kernel's GPU tiles need; choose 32, 64 or 128, or leave it null.")
    if not gpu and (block < tiles.LANES or block % tiles.LANES):
      return (f"attention.{key} {block} is not a multiple of {tiles.LANES}, which the flash kernel's TPU tiles "
              f"need; choose 128, 256, 512 or 1024, or leave it null.")
  local = p.seq_len // p.context
  if local % tiles.LANES:
    return (f"the flash kernel needs the {local} tokens per device (data.seq_len {p.seq_len} / context "
            f"{p.context}) to be a multiple of {tiles.LANES}; choose a data.seq_len that is a multiple of "
            f"{tiles.LANES * p.context}.")
  if p.head_dim is None:
    return None
  if gpu and (p.head_dim < flash_gpu.MIN_BLOCK or p.head_dim & (p.head_dim - 1) or p.head_dim > 256):
    return (f"the flash kernel on a GPU needs model.head_dim to be a power of two from {flash_gpu.MIN_BLOCK} to 256, "
            f"not {p.head_dim}; use attention.kernel=blockwise for this model.")
  if not gpu and p.head_dim % tiles.LANES:
    return (f"the flash kernel needs model.head_dim to be a multiple of {tiles.LANES} (the TPU's lanes), not "
            f"{p.head_dim}; use attention.kernel=blockwise for this model.")
  return None
