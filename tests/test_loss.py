"""The chunked loss equals the plain one and never holds the full [tokens, vocab] logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxctx import config
from maxctx.model import loss


def _plain(h, w, targets, weights):
  logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h, w), axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.sum(nll * weights), jnp.sum(weights)


@pytest.mark.parametrize("chunk", [8, 32, 64])
def test_chunked_loss_and_grads_equal_plain(chunk):
  k = jax.random.split(jax.random.key(0), 4)
  h = jax.random.normal(k[0], (2, 64, 16))
  w = jax.random.normal(k[1], (16, 50))
  targets = jax.random.randint(k[2], (2, 64), 0, 50)
  weights = (jax.random.uniform(k[3], (2, 64)) > 0.2).astype(jnp.float32)
  got = jax.value_and_grad(lambda h, w: loss.chunked_cross_entropy(h, w, targets, weights, chunk)[0],
                           argnums=(0, 1))(h, w)
  want = jax.value_and_grad(lambda h, w: _plain(h, w, targets, weights)[0], argnums=(0, 1))(h, w)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, e in zip(got[1], want[1]):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_compiled_loss_holds_no_full_logits():
  # At the default model.loss_chunk; the small width D keeps the compile light, the [tokens, vocab] shape is real.
  tokens, vocab, d = 32_768, 128_256, 64
  full_logits_bytes = tokens * vocab * 4
  h = jax.ShapeDtypeStruct((1, tokens, d), jnp.float32)
  w = jax.ShapeDtypeStruct((d, vocab), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
  weights = jax.ShapeDtypeStruct((1, tokens), jnp.float32)
  chunk = loss.global_chunk(config.load(None).model.loss_chunk, tokens)
  fn = jax.jit(jax.value_and_grad(lambda h, w, t, m: loss.chunked_cross_entropy(h, w, t, m, chunk)[0],
                                  argnums=(0, 1)))
  temp = fn.lower(h, w, ids, weights).compile().memory_analysis().temp_size_in_bytes
  assert temp < full_logits_bytes / 8, f"loss temp {temp / 2**30:.2f} GiB"


@pytest.mark.parametrize("local, seq_len, want", [(512, 4096, 4096), (3, 56, 8), (2, 64, 16), (100, 8, 8)])
def test_loss_chunk_splits_evenly_over_the_context_axis(local, seq_len, want):
  # A chunk that is not a multiple of the context degree would make XLA reshuffle the hidden states between devices.
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(1, 1, 8, 1), ("data", "fsdp", "context", "tensor"))
  with jax.set_mesh(mesh):
    chunk = loss.global_chunk(local, seq_len)
  assert chunk == want and chunk % 8 == 0 and seq_len % chunk == 0

