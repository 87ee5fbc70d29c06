"""Token cross-entropy without materialising the [tokens, vocab] logits.

The final hidden states are cut into S steps of C tokens; a scan computes each step's logits, log-sum-exp and target
logit, and `jax.checkpoint` makes the backward pass recompute them rather than store them, so at most one step's
logits exist at a time. At 128K local tokens and a 128K vocabulary the full logits would be 64 GiB in float32.

The chunk is strided (step s holds tokens s, s+S, s+2S, ...) so that, with the sequence sharded over the context
axis, every device holds C/P tokens of every step and no step needs communication of activations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxctx import sharding


def global_chunk(local_chunk: int, seq_len: int) -> int:
  """Tokens of a sequence per loss step: `local_chunk` per device of the sequence's shards, at most the sequence."""
  chunk = min(seq_len, local_chunk * sharding.shards("seq"))
  while seq_len % chunk:  # the largest divisor of seq_len not above the request
    chunk -= 1
  return chunk


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

  @jax.checkpoint
  def step(total, xs):
    h_BCD, targets_BC, weights_BC = xs
    h_BCD = sharding.constrain(h_BCD, ("batch", "seq", "act_embed"))
    logits_BCV = jnp.einsum("bcd,dv->bcv", h_BCD, w_DV, preferred_element_type=jnp.float32)
    logits_BCV = sharding.constrain(logits_BCV, ("batch", "seq", "act_vocab"))
    lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits_BCV.shape, 2)
    target_logit_BC = jnp.sum(jnp.where(vocab_ids == targets_BC[..., None], logits_BCV, 0.0), axis=-1)
    return total + jnp.sum((lse_BC - target_logit_BC) * weights_BC), None

  total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32),
                          (to_steps(h_BTD), to_steps(targets_BT), to_steps(weights_BT)))
  return total, jnp.sum(weights_BT)
