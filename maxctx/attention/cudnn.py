"""cudnn: `jax.nn.dot_product_attention` with cuDNN's fused flash attention on NVIDIA GPUs (optional).

The contract's mask goes in as a boolean [B, 1, Tq, Tk] mask, which cuDNN reads as a bias: exact for any layout,
but the mask itself is quadratic in the local lengths, so this kernel suits all_gather and ulysses at modest
lengths; the blockwise kernel has no such limit. Rows that see no key (padding) are zeroed, as in every kernel.
Off the GPU (tests) it runs the same call with XLA's implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxctx.attention import mask


def make(block_q: int | None = None, block_kv: int | None = None, implementation: str | None = "cudnn"):
  del block_q, block_kv   # cuDNN picks its own tiles

  def attend(q_BTNH, k_BSKH, v_BSKH, q_segment_ids, kv_segment_ids, q_positions, kv_positions):
    visible_BTS = mask.visible(q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    impl = implementation if jax.default_backend() == "gpu" else None
    out_BTNH = jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=visible_BTS[:, None], implementation=impl)
    seen_BT = jnp.any(visible_BTS, axis=-1)
    return jnp.where(seen_BT[:, :, None, None], out_BTNH, 0).astype(q_BTNH.dtype)

  return attend
