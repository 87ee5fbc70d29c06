"""splash: TPU Pallas splash attention (jax.experimental.pallas.ops.tpu.splash_attention) as a local kernel.

Splash takes a static mask, so it expresses the contract's mask only where token order is document order: a causal
mask on indices plus segment ids equals `mask.visible` when positions rise with the index inside each document.
That holds for ulysses over a natural (not zigzag) layout, where each device attends over the whole sequence in
order, and nowhere else; the strategies' `validate` refuses the rest. Padding rows (segment 0) attend to each other
in splash instead of getting zeros; they carry no loss, so training is unaffected. GQA runs the MQA kernel once
per KV head. `interpret=True` runs it through the Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def make(block_q: int | None = None, block_kv: int | None = None, interpret: bool = False):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  @functools.cache
  def kernel(t: int, heads: int):
    bq, bk = min(block_q or 512, t), min(block_kv or 512, t)
    sizes = sk.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                          block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(heads)])
    return sk.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)

  def attend(q_BTNH, k_BSKH, v_BSKH, q_segment_ids, kv_segment_ids, q_positions, kv_positions):
    del q_positions, kv_positions   # order is document order (validate), so the causal mask on indices is exact
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    splash = kernel(T, N // K)
    q_BKGTH = jnp.transpose((q_BTNH * H**-0.5).reshape(B, T, K, N // K, H), (0, 2, 3, 1, 4))
    k_BKSH, v_BKSH = jnp.transpose(k_BSKH, (0, 2, 1, 3)), jnp.transpose(v_BSKH, (0, 2, 1, 3))

    def one(q_GTH, k_SH, v_SH, q_seg, kv_seg):
      return splash(q_GTH, k_SH, v_SH, segment_ids=sk.SegmentIds(q=q_seg, kv=kv_seg))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None, None))
    out_BKGTH = jax.vmap(per_head)(q_BKGTH, k_BKSH, v_BKSH, q_segment_ids, kv_segment_ids)
    return jnp.transpose(out_BKGTH, (0, 3, 1, 2, 4)).reshape(B, T, N, H).astype(q_BTNH.dtype)

  return attend
