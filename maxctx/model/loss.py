"""Token cross-entropy without materialising the [tokens, vocab] logits.

The final hidden states are cut into S steps of C tokens; a scan computes each step's logits, log-sum-exp and target
logit, and a custom backward recomputes them rather than storing them, so at most one step's logits exist at a
time. At 128K local tokens and a 128K vocabulary the full logits would be 64 GiB in float32.

The chunk is strided (step s holds tokens s, s+S, s+2S, ...) so that, with the sequence sharded over the context
axis, every device holds C/P tokens of every step and no step needs communication of activations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxctx import sharding
from maxctx.chunks import divisor_at_most


def global_chunk(local_chunk: int, seq_len: int) -> int:
  """Tokens of a sequence per loss step: P × (the largest divisor of seq_len/P not above `local_chunk`), P the
  sequence's shards, so each step's chunk splits evenly over the devices that hold the sequence."""
  shards = sharding.shards("seq")
  if seq_len % shards:
    shards = 1
  return divisor_at_most(local_chunk, seq_len // shards) * shards


def _logits(h_BCD, w_DV):
  # w_DV stays in its stored dtype across the scan, so its gradient is summed over steps in float32; the cast to the
  # compute dtype is per step and fuses into the matmul.
  h_BCD = sharding.constrain(h_BCD, ("batch", "seq", "act_embed"))
  logits_BCV = jnp.einsum("bcd,dv->bcv", h_BCD, w_DV.astype(h_BCD.dtype), preferred_element_type=jnp.float32)
  return sharding.constrain(logits_BCV, ("batch", "seq", "act_vocab"))


def _is_target(logits_BCV, targets_BC):
  vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits_BCV.shape, 2)
  return vocab_ids == targets_BC[..., None]


@jax.custom_vjp
def _chunk_loss(h_BCD, w_DV, targets_BC, weights_BC):
  return _chunk_loss_fwd(h_BCD, w_DV, targets_BC, weights_BC)[0]


def _chunk_loss_fwd(h_BCD, w_DV, targets_BC, weights_BC):
  logits_BCV = _logits(h_BCD, w_DV)
  lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
  target_logit_BC = jnp.sum(jnp.where(_is_target(logits_BCV, targets_BC), logits_BCV, 0.0), axis=-1)
  return jnp.sum((lse_BC - target_logit_BC) * weights_BC), (h_BCD, w_DV, targets_BC, weights_BC, lse_BC)


def _chunk_loss_bwd(residuals, g):
  # The logits are recomputed, and their gradient (softmax − one-hot) is formed in the same buffer: one [C, V]
  # array per step instead of the several that autodiff of logsumexp would keep.
  h_BCD, w_DV, targets_BC, weights_BC, lse_BC = residuals
  logits_BCV = _logits(h_BCD, w_DV)
  probs_BCV = jnp.exp(logits_BCV - lse_BC[..., None])
  scale_BC = (weights_BC * g)[..., None]
  dlogits_BCV = (jnp.where(_is_target(logits_BCV, targets_BC), probs_BCV - 1.0, probs_BCV) * scale_BC)
  dh_BCD = jnp.einsum("bcv,dv->bcd", dlogits_BCV.astype(h_BCD.dtype), w_DV.astype(h_BCD.dtype),
                      preferred_element_type=jnp.float32).astype(h_BCD.dtype)
  dw_DV = jnp.einsum("bcd,bcv->dv", h_BCD, dlogits_BCV.astype(h_BCD.dtype),
                     preferred_element_type=jnp.float32).astype(w_DV.dtype)
  return dh_BCD, dw_DV, None, None


_chunk_loss.defvjp(_chunk_loss_fwd, _chunk_loss_bwd)


def chunked_cross_entropy(h_BTD, w_DV, targets_BT, weights_BT, chunk: int):
  """(sum of weighted token losses, sum of weights), both float32 scalars.

  `w_DV` should arrive gathered (the model's weights are): it is loop-invariant, so it is gathered once, not per step.
  """
  B, T, D = h_BTD.shape
  steps = T // chunk
  if steps * chunk != T:
    raise ValueError(f"loss chunk {chunk} does not divide the sequence length {T}")

  def to_steps(x_BT_):  # [B, T, ...] -> [S, B, C, ...] with token t = c·S + s
    x = x_BT_.reshape(B, chunk, steps, *x_BT_.shape[2:])
    return jnp.moveaxis(x, 2, 0)

  def step(total, xs):
    return total + _chunk_loss(*xs[:1], w_DV, *xs[1:]), None

  total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32),
                          (to_steps(h_BTD), to_steps(targets_BT), to_steps(weights_BT)))
  return total, jnp.sum(weights_BT)
