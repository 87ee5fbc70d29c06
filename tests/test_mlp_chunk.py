"""model.mlp_chunk: the MLP in strided token steps gives the plain MLP's output and gradients, and its compiled
forward+backward never holds the whole [tokens, d_ff] activations (6 GiB each at the v5p 14M recipe's 229K tokens per
device)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxctx import config
from maxctx.model.transformer import MLP


def _mlp(chunk, d_model=32, d_ff=128, dtype="float32"):
  cfg = config.load(None).model
  cfg = type(cfg)(**{**cfg.__dict__, "d_model": d_model, "d_ff": d_ff, "mlp_chunk": chunk, "dtype": dtype})
  return MLP(cfg)


def _value_and_grads(chunk, x_BTD, **kw):
  module = _mlp(chunk, **kw)
  params = module.init(jax.random.key(1), x_BTD)
  loss = lambda p, x: jnp.sum(jnp.sin(module.apply(p, x).astype(jnp.float32)))  # noqa: E731
  return jax.value_and_grad(loss, argnums=(0, 1))(params, x_BTD)


@pytest.mark.parametrize("chunk", [4, 8])   # local tokens per step: 6 and 3 steps of the 24 per device
def test_chunked_mlp_equals_plain_on_a_context_mesh(chunk):
  # 4 devices hold the sequence: every step takes chunk/4 tokens from each, in the strided order.
  mesh = Mesh(np.asarray(jax.devices()).reshape(1, 2, 4, 1), ("data", "fsdp", "context", "tensor"))
  x_BTD = jax.random.normal(jax.random.key(0), (2, 96, 32))
  with jax.set_mesh(mesh):
    x_BTD = jax.device_put(x_BTD, NamedSharding(mesh, P(("data", "fsdp"), "context")))
    want = jax.jit(lambda x: _value_and_grads(0, x))(x_BTD)
    got = jax.jit(lambda x: _value_and_grads(chunk, x))(x_BTD)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, e in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_chunked_mlp_holds_one_step_of_activations():
  tokens, d_model, d_ff = 16_384, 64, 2048
  x = jax.ShapeDtypeStruct((1, tokens, d_model), jnp.bfloat16)

  def temp(chunk):
    fn = jax.jit(lambda x: _value_and_grads(chunk, x, d_model=d_model, d_ff=d_ff, dtype="bfloat16"))
    return fn.lower(x).compile().memory_analysis().temp_size_in_bytes

  one_activation = tokens * d_ff * 2   # a [tokens, d_ff] bfloat16 array
  plain, chunked = temp(0), temp(1024)
  assert plain > 2 * one_activation, f"the plain MLP holds {plain / 2**20:.0f} MiB"
  assert chunked < one_activation, f"chunked MLP temp {chunked / 2**20:.0f} MiB (plain {plain / 2**20:.0f} MiB)"


@pytest.mark.parametrize("key", ["model.mlp_chunk", "model.loss_chunk"])
def test_a_chunk_far_from_a_divisor_is_refused(key):
  """The MLP's and the loss's steps split the tokens per device evenly; a chunk that would run as steps of half of
  what was asked or less is refused before compiling, rather than silently running many more steps."""
  from maxctx import trainer
  from maxctx.errors import ConfigError
  c = config.load("configs/demo.yml", ["mesh.ici.fsdp=1", "mesh.ici.context=8", "data.seq_len=1016",
                                       "attention.load_balance=false", f"{key}=100"])   # 127 per device
  with pytest.raises(ConfigError, match=f"{key} 100 does not divide the 127 tokens per device and would "
                                        "run as steps of 1; choose a divisor of 127"):
    trainer.validate(c, 8)
  # 128 tokens per device: 30 runs as steps of 16, more than half of what was asked, so it is accepted.
  trainer.validate(config.load("configs/demo.yml", [f"{key}=30"]), 8)
