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

from maxctx import attention, chunks, mesh as mesh_lib, optim, sharding, stages as stages_lib
from maxctx import config as config_lib
from maxctx.config import Config
from maxctx.data import mixture as data_mixture
from maxctx.errors import ConfigError
from maxctx import model as model_lib
from maxctx.model import Transformer


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def validate(config: Config, num_devices: int, num_slices: int = 1, platform: str | None = None) -> dict[str, int]:
  """The one check of a run against its devices, before anything is read, written or compiled: each part's own rules,
  once, with one-sentence errors. Returns the mesh axis sizes (the first stage's, with run.stages, whose every stage
  is checked so). `platform` is the one the step will run on (default: this process's backend; `tpu` when compiling
  ahead of time from a CPU)."""
  config_lib.check(config)                                   # each key's value on its own
  if config.run.stages:
    sizes = []
    for stage in stages_lib.check(config):                   # the schedule, then each stage as a run of its own
      with stages_lib.named(stage, config):
        sizes.append(validate(stage.config, num_devices, num_slices, platform))
    return sizes[0]
  data_mixture.check(config)                                 # data.source and data.mixture name one stream
  if config.model.remat == "auto":
    raise ConfigError("model.remat auto is resolved only by maxctx.train, which measures the policies on the devices "
                      "present, and by maxctx.compile, which plans for its TPU slice; elsewhere name a policy, e.g. "
                      "from the recipe.yml of python -m maxctx.plan CONFIG --remat auto.")
  sizes = mesh_lib.axis_sizes(config.mesh, num_devices, num_slices)
  _check_batch(config, sizes)                                # the step's microbatches over the batch shards
  attention.validate(attention_problem(config, sizes, platform))  # heads, layout, kernel
  _check_shardable(config, sizes)                            # the other model dimensions over the mesh
  _check_chunks(config, sizes)                               # the model's loss and MLP steps over local tokens
  _check_remat_group(config)                                 # nested remat over groups of scanned layers
  _check_offload(config, sizes, platform or jax.default_backend())   # what libtpu can copy to host memory
  return sizes


def _check_batch(config: Config, sizes: dict[str, int]) -> None:
  d, accum = config.data, config.optim.grad_accum
  if d.batch_size % accum:
    raise ConfigError(f"data.batch_size {d.batch_size} is not divisible by optim.grad_accum {accum}; "
                      "each microbatch must hold a whole number of sequences.")
  batch_shards = sizes["data"] * sizes["fsdp"]
  micro = d.batch_size // accum
  if micro % batch_shards:
    raise ConfigError(f"a microbatch of {micro} sequences (data.batch_size / optim.grad_accum) does not split over "
                      f"the {batch_shards} data×fsdp shards of the mesh; make it a multiple of {batch_shards}.")


def _check_shardable(config: Config, sizes: dict[str, int]) -> None:
  m = config.model
  # The parameters' dimensions that maxctx.sharding splits over mesh axes (the heads are attention's own check).
  for key, dim, logical in (("model.vocab_size", m.vocab_size, "vocab"), ("model.d_ff", m.d_ff, "mlp"),
                            ("model.d_model", m.d_model, "embed")):
    ways = sharding.ways(logical, sizes)
    if dim % ways:
      axes = dict(sharding.RULES)[logical]
      over = " × ".join(f"{a} {sizes[a]}" for a in axes if sizes[a] > 1)
      raise ConfigError(f"{key} {dim} is not divisible by the {ways} shards of the mesh ({over}) that its parameters "
                        f"are split over; choose mesh sizes whose product divides {dim}, or a {key} they divide.")


def _check_chunks(config: Config, sizes: dict[str, int]) -> None:
  m = config.model
  local = config.data.seq_len // sizes["context"]
  for key, chunk in (("model.loss_chunk", m.loss_chunk), ("model.mlp_chunk", m.mlp_chunk)):
    # The loss's and the MLP's steps must split the device's tokens evenly; a chunk far below the one asked for would
    # mean many more sequential steps than intended.
    used = chunks.divisor_at_most(chunk, local)
    if 0 < chunk < local and 2 * used <= chunk:
      raise ConfigError(f"{key} {chunk} does not divide the {local} tokens per device and would run as steps of "
                        f"{used}; choose a divisor of {local}.")


# libtpu (0.0.50.1) aborts compiling a host-offload copy of exactly 4 GiB ("Check failed: index_space_.start <=
# index_space_.limit (0 vs. -1)": a 32-bit count wrapped to 0); one of 4 GiB + 32 MiB compiled, but were the count the
# same 32 bits it would copy 32 MiB, and nothing short of a TPU shows which. So no copy of 4 GiB or more is made: a
# larger saved input goes to host memory in slices of the model width (offload_pieces).
OFFLOAD_COPY_LIMIT = 2**32


def _check_remat_group(config: Config) -> None:
  m = config.model
  if m.remat_group == 1:
    return
  if m.remat not in model_lib.GROUPED_REMATS:
    raise ConfigError(f"model.remat_group {m.remat_group} groups layers only under model.remat full or full_offload, "
                      f"not {m.remat}; set model.remat_group: 1 or one of those policies.")
  if not m.scan_layers:
    raise ConfigError(f"model.remat_group {m.remat_group} needs model.scan_layers: true (the groups are slices of the "
                      "scanned layers); set it, or model.remat_group: 1.")
  if m.n_layers % m.remat_group:
    raise ConfigError(f"model.remat_group {m.remat_group} does not divide the model's {m.n_layers} layers; choose a "
                      "divisor of model.n_layers.")


# A slice of the width is a whole number of TPU lanes, so each copy moves rows of whole tiles.
OFFLOAD_SLICE_MULTIPLE = 128


def _saved_input_bytes(config: Config, sizes: dict[str, int]) -> int:
  m = config.model
  return offloaded_bytes_per_device(config, sizes) // (m.n_layers // m.remat_group)


def offload_pieces(config: Config, sizes: dict[str, int]) -> int:
  """Slices of the model width each saved input is copied to host memory in: the fewest, each a multiple of
  OFFLOAD_SLICE_MULTIPLE wide, that keep every copy under OFFLOAD_COPY_LIMIT (1 under policies that offload nothing;
  0 if no such slicing does). The limit is libtpu's, but the slices are the same on every platform, so that a step
  checked on the CPU is the step a TPU runs."""
  d, saved = config.model.d_model, _saved_input_bytes(config, sizes)
  return next((p for p in range(1, d + 1) if d % p == 0 and saved // p < OFFLOAD_COPY_LIMIT
               and (p == 1 or (d // p) % OFFLOAD_SLICE_MULTIPLE == 0)), 0)


def _check_offload(config: Config, sizes: dict[str, int], platform: str) -> None:
  if platform == "tpu" and not offload_pieces(config, sizes):
    raise ConfigError(f"model.remat full_offload would copy saved layer inputs of "
                      f"{_saved_input_bytes(config, sizes) / 2**20:,.0f} MiB per device to host memory, and no slicing "
                      f"of the model width into multiples of {OFFLOAD_SLICE_MULTIPLE} brings a copy under "
                      f"{OFFLOAD_COPY_LIMIT // 2**20:,} MiB, which libtpu needs; put more devices on mesh.ici.context "
                      "or shorten data.seq_len.")


def attention_problem(config: Config, sizes: dict[str, int], platform: str | None = None) -> attention.Problem:
  """What the attention strategy is asked to run: the model's heads, the sequence and the mesh's degrees."""
  m = config.model
  return attention.Problem(config.attention, context=sizes["context"], tensor=sizes["tensor"], n_heads=m.n_heads,
                           n_kv_heads=m.n_kv_heads, seq_len=config.data.seq_len, platform=platform,
                           head_dim=m.head_dim)


def build_model(config: Config, mesh: Mesh | None) -> Transformer:
  attention_fn = attention.build(config.attention, mesh) if mesh is not None else None
  pieces = max(1, offload_pieces(config, dict(mesh.shape))) if mesh is not None else 1
  return Transformer(config.model, attention_fn, pieces)


def init_params(model: Transformer, rng: jax.Array, seq_len: int) -> Any:
  """The model's parameters (boxed with their logical axis names). Their shapes depend on neither the batch nor the
  length; one row per batch shard keeps shard_map's shapes divisible, and XLA drops the unused forward pass."""
  tokens = jnp.zeros((sharding.shards("batch"), seq_len), jnp.int32)
  return model.init(rng, tokens, tokens, tokens)["params"]


def param_shapes(model: Transformer, mesh: Mesh, seq_len: int) -> tuple[Any, Any]:
  """(ShapeDtypeStructs with shardings, a jitted init from an rng) of the model's parameters on `mesh`."""
  boxed = jax.eval_shape(lambda rng: init_params(model, rng, seq_len), jax.random.key(0))
  shardings = sharding.tree_shardings(mesh, boxed)
  shapes = jax.tree.map(lambda b, s: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=s), nn.unbox(boxed), shardings)
  return shapes, jax.jit(lambda rng: nn.unbox(init_params(model, rng, seq_len)), out_shardings=shardings)


def offloaded_bytes_per_device(config: Config, sizes: dict[str, int]) -> int:
  """Host memory that `remat: full_offload` fills per device: every layer group's saved input (every layer's, with
  model.remat_group 1), [rows, tokens, d_model] of one microbatch in the compute dtype (0 under the other policies)."""
  m, d = config.model, config.data
  if m.remat != "full_offload":
    return 0
  rows = max(1, d.batch_size // config.optim.grad_accum // (sizes["data"] * sizes["fsdp"]))
  saved = m.n_layers // m.remat_group
  return saved * rows * (d.seq_len // sizes["context"]) * m.d_model * jnp.dtype(m.dtype).itemsize


@dataclasses.dataclass
class Trainer:
  """Holds the compiled pieces of a run: model, optimizer, shardings, and the jitted init and step."""
  config: Config
  mesh: Mesh
  # The learning-rate schedule spans run.steps from update 0, or, for a stage that resets it, its own steps from its
  # first (maxctx.stages).
  schedule_start: int = 0
  schedule_steps: int | None = None

  def __post_init__(self):
    self.model = build_model(self.config, self.mesh)
    steps = self.schedule_steps or self.config.run.steps
    self.tx = optim.build(self.config.optim, steps, self.schedule_start)
    self.lr_schedule = optim.schedule(self.config.optim, steps, self.schedule_start)
    abstract = jax.eval_shape(self._init_boxed, jax.random.key(0))
    self.state_shardings = sharding.tree_shardings(self.mesh, abstract)
    self.batch_shardings = sharding.batch_sharding(self.mesh)
    self._init = jax.jit(lambda rng: nn.unbox(self._init_boxed(rng)), out_shardings=self.state_shardings)
    self.step = jax.jit(self._step, in_shardings=(self.state_shardings, self.batch_shardings),
                        out_shardings=(self.state_shardings, sharding.replicated(self.mesh)), donate_argnums=(0,))

  def _init_boxed(self, rng) -> TrainState:
    params = init_params(self.model, rng, self.config.data.seq_len)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params))

  def init(self, rng) -> TrainState:
    """A fresh state (step 0) from `rng`, on this trainer's mesh."""
    with jax.set_mesh(self.mesh):   # a stage's trainer may be asked while another stage's mesh is current
      return self._init(rng)

  def abstract_state(self) -> TrainState:
    """The train state's shapes, dtypes and shardings, without allocating it."""
    rng = jax.random.key(0)   # made outside: the mesh may be a TPU slice's, with no device here to hold it
    with jax.set_mesh(self.mesh):
      shapes = jax.eval_shape(self._init, rng)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                        self.state_shardings)

  def loss_sum(self, params, batch):
    """(summed token loss, token count) of a batch."""
    x_BTD = self.model.apply({"params": params}, batch["tokens"], batch["segment_ids"], batch["positions"])
    return model_lib.token_loss(self.config.model, params, x_BTD, batch["targets"], batch["segment_ids"])

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
