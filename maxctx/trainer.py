"""The train state, the pure train step, and the checks that refuse a run before anything compiles."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from maxctx import attention, chunks, mesh as mesh_lib, optim, sharding
from maxctx.config import Config
from maxctx.errors import ConfigError
from maxctx.model import Transformer


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def validate(config: Config, num_devices: int, num_slices: int = 1, platform: str | None = None) -> dict[str, int]:
  """Every check a user's config can fail, with one-sentence errors; returns the mesh axis sizes. `platform` is the
  one the step will run on (default: this process's backend; `tpu` when compiling ahead of time from a CPU)."""
  sizes = mesh_lib.axis_sizes(config.mesh, num_devices, num_slices)
  m, d, o = config.model, config.data, config.optim
  for key, value, least in (("model.n_heads", m.n_heads, 1), ("model.n_kv_heads", m.n_kv_heads, 1),
                            ("model.n_layers", m.n_layers, 1), ("model.d_model", m.d_model, 1),
                            ("model.head_dim", m.head_dim, 2), ("model.d_ff", m.d_ff, 1),
                            ("model.vocab_size", m.vocab_size, 2), ("data.batch_size", d.batch_size, 1),
                            ("metrics.log_every", config.metrics.log_every, 1),
                            ("optim.warmup_steps", o.warmup_steps, 0), ("optim.decay_steps", o.decay_steps, 0),
                            ("checkpoint.every_steps", config.checkpoint.every_steps, 0)):
    if value < least:
      raise ConfigError(f"{key} is {value}; it must be at least {least}.")
  if d.seq_len < 2:
    raise ConfigError(f"data.seq_len is {d.seq_len}; a sequence needs at least 2 tokens (an input and its target).")
  # (key, value, least, most, whether the least itself is allowed): 0 switches lr decay, weight decay, clipping, a
  # momentum and the peak override off; an epsilon, a scale or a base of 0 breaks the numerics.
  for key, value, least, most, closed in (
      ("optim.lr", o.lr, 0.0, None, True), ("optim.min_lr_ratio", o.min_lr_ratio, 0.0, 1.0, True),
      ("optim.b1", o.b1, 0.0, 1.0, True), ("optim.b2", o.b2, 0.0, 1.0, True), ("optim.eps", o.eps, 0.0, None, False),
      ("optim.weight_decay", o.weight_decay, 0.0, None, True), ("optim.clip_norm", o.clip_norm, 0.0, None, True),
      ("model.norm_eps", m.norm_eps, 0.0, None, False), ("model.rope_theta", m.rope_theta, 0.0, None, False),
      ("model.init_std", m.init_std, 0.0, None, False),
      ("metrics.peak_tflops", config.metrics.peak_tflops, 0.0, None, True)):
    if value < least or (value == least and not closed) or (most is not None and value > most):
      allowed = f"in [{least:g}, {most:g}]" if most is not None else f"{'at least' if closed else 'above'} {least:g}"
      raise ConfigError(f"{key} is {value:g}; it must be {allowed}.")
  if m.n_heads % m.n_kv_heads:
    raise ConfigError(f"model.n_heads {m.n_heads} is not a multiple of model.n_kv_heads {m.n_kv_heads}; "
                      "grouped-query attention needs each KV head to serve the same number of query heads.")
  if m.head_dim % 2:
    raise ConfigError(f"model.head_dim {m.head_dim} must be even for rotary embeddings.")
  for key, heads in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads)):
    if heads % sizes["tensor"]:
      raise ConfigError(f"{key} {heads} is not divisible by the tensor degree {sizes['tensor']} "
                        "(mesh.ici.tensor × mesh.dcn.tensor); choose a tensor degree that divides both head counts.")
  batch_shards = sizes["data"] * sizes["fsdp"]
  if o.grad_accum < 1 or d.batch_size % o.grad_accum:
    raise ConfigError(f"data.batch_size {d.batch_size} is not divisible by optim.grad_accum {o.grad_accum}; "
                      "each microbatch must hold a whole number of sequences.")
  micro = d.batch_size // o.grad_accum
  if micro % batch_shards:
    raise ConfigError(f"a microbatch of {micro} sequences (data.batch_size / optim.grad_accum) does not split over "
                      f"the {batch_shards} data×fsdp shards of the mesh; make it a multiple of {batch_shards}.")
  if d.seq_len % sizes["context"]:
    raise ConfigError(f"data.seq_len {d.seq_len} is not divisible by the context degree {sizes['context']}; "
                      f"choose a multiple of {sizes['context']}.")
  if config.run.steps < 1:
    raise ConfigError(f"run.steps is {config.run.steps}; train at least one step.")
  if m.loss_chunk < 1:
    raise ConfigError(f"model.loss_chunk is {m.loss_chunk}; it must be a positive number of tokens.")
  if m.mlp_chunk < 0:
    raise ConfigError(f"model.mlp_chunk is {m.mlp_chunk}; it must be a number of tokens, or 0 for the whole "
                      "sequence at once.")
  local = d.seq_len // sizes["context"]
  for key, chunk in (("model.loss_chunk", m.loss_chunk), ("model.mlp_chunk", m.mlp_chunk)):
    # The loss's and the MLP's steps must split the device's tokens evenly; a chunk far below the one asked for would
    # mean many more sequential steps than intended.
    used = chunks.divisor_at_most(chunk, local)
    if 0 < chunk < local and 2 * used <= chunk:
      raise ConfigError(f"{key} {chunk} does not divide the {local} tokens per device and would run as steps of "
                        f"{used}; choose a divisor of {local}.")
  attention.validate(config.attention.strategy, attention_problem(config, sizes, platform))
  return sizes


def attention_problem(config: Config, sizes: dict[str, int], platform: str | None = None) -> attention.Problem:
  """What the attention strategy is asked to run: the model's heads, the sequence and the mesh's degrees."""
  m, a = config.model, config.attention
  return attention.Problem(
      context=sizes["context"], tensor=sizes["tensor"], n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
      seq_len=config.data.seq_len, kernel=a.kernel, load_balance=a.load_balance, ulysses_degree=a.ulysses_degree,
      block_q=a.block_q, block_kv=a.block_kv, platform=platform, head_dim=m.head_dim)


def build_model(config: Config, mesh: Mesh | None) -> Transformer:
  a = config.attention
  attention_fn = None
  if mesh is not None:
    attention_fn = attention.build(a.strategy, mesh, kernel=a.kernel, load_balance=a.load_balance,
                                   ulysses_degree=a.ulysses_degree, block_q=a.block_q, block_kv=a.block_kv)
  return Transformer(config.model, attention_fn)


def offloaded_bytes_per_device(config: Config, sizes: dict[str, int]) -> int:
  """Host memory that `remat: full_offload` fills per device: every layer's saved input, [rows, tokens, d_model] of
  one microbatch in the compute dtype (0 under the other policies)."""
  m, d = config.model, config.data
  if m.remat != "full_offload":
    return 0
  rows = max(1, d.batch_size // config.optim.grad_accum // (sizes["data"] * sizes["fsdp"]))
  return m.n_layers * rows * (d.seq_len // sizes["context"]) * m.d_model * jnp.dtype(m.dtype).itemsize


@dataclasses.dataclass
class Trainer:
  """Holds the compiled pieces of a run: model, optimizer, shardings, and the jitted init and step."""
  config: Config
  mesh: Mesh

  def __post_init__(self):
    self.model = build_model(self.config, self.mesh)
    self.tx = optim.build(self.config.optim, self.config.run.steps)
    self.lr_schedule = optim.schedule(self.config.optim, self.config.run.steps)
    abstract = jax.eval_shape(self._init_boxed, jax.random.key(0))
    self.state_shardings = sharding.tree_shardings(self.mesh, abstract)
    self.batch_shardings = sharding.batch_sharding(self.mesh)
    self.init = jax.jit(lambda rng: nn.unbox(self._init_boxed(rng)), out_shardings=self.state_shardings)
    self.step = jax.jit(self._step, in_shardings=(self.state_shardings, self.batch_shardings),
                        out_shardings=(self.state_shardings, sharding.replicated(self.mesh)), donate_argnums=(0,))

  def _init_boxed(self, rng) -> TrainState:
    d = self.config.data
    # Parameter shapes do not depend on the batch; one row per batch shard keeps shard_map's shapes divisible, and XLA
    # drops the unused forward pass.
    tokens = jnp.zeros((sharding.shards("batch"), d.seq_len), jnp.int32)
    params = self.model.init(rng, tokens, tokens, tokens)["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params))

  def loss_sum(self, params, batch):
    """(summed token loss, token count) of a batch."""
    return self.model.apply({"params": params}, batch["tokens"], batch["segment_ids"], batch["positions"],
                            batch["targets"])

  def _grads(self, params, batch, n_tokens):
    """Mean-loss gradients over the whole batch, accumulated over optim.grad_accum microbatches."""
    accum = self.config.optim.grad_accum

    def micro_grads(mb):
      def f(p):
        total, _ = self.loss_sum(p, mb)
        return total / n_tokens
      return jax.value_and_grad(f)(params)

    if accum == 1:
      return micro_grads(batch)

    def split(x):  # [B, T] -> [A, B/A, T], microbatch a = rows a, a+A, ... so every shard keeps its rows.
      x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:])
      return sharding.constrain(jnp.moveaxis(x, 1, 0), (None, "batch", "seq"))

    def body(carry, mb):
      loss, grads = carry
      l, g = micro_grads(mb)
      return (loss + l, jax.tree.map(jnp.add, grads, g)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(body, zeros, jax.tree.map(split, batch))
    return loss, grads

  def _step(self, state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
    with jax.named_scope("train_step"):
      n_tokens = jnp.maximum(jnp.sum(batch["segment_ids"] != 0), 1).astype(jnp.float32)
      loss, grads = self._grads(state.params, batch, n_tokens)
      grad_norm = optax.tree.norm(grads)
      updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      new = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      if self.config.run.on_nan == "skip":
        # Keep the previous parameters and optimizer state; only the step counter moves on.
        new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state.replace(step=state.step + 1))
      metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": self.lr_schedule(optim.updates_done(state)),
                 "tokens": n_tokens, "finite": finite}
      return new, metrics
