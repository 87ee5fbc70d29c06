"""The Llama 3.1 decoder.

Dimension letters, used in names and einsums:
  B batch   T tokens (sequence)   D model width   N query heads   K key/value heads   H head dim
  F MLP width   V vocabulary   L layers   C chunk (loss, MLP)   S steps (of chunks)

Parameters are float32 and computed in `ModelConfig.dtype`. Every parameter and activation is annotated with logical
axis names (maxctx.sharding maps them to the mesh). Attention goes through `attention_fn`, built by
maxctx.attention for the run's context-parallel strategy; without one the dense reference kernel runs.
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from maxctx import scopes
from maxctx.attention import blockwise, kernels
from maxctx.config import ModelConfig
from maxctx.model import loss as loss_lib
from maxctx.model import rope
from maxctx.sharding import constrain

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # What the attention kernels' custom backward needs from their forward, named where the kernels make it: the
    # output and its softmax statistics. The backward then reruns the projections and the MLP but not attention. (The
    # output as the layer sees it is the same value; naming it here too would save it twice.)
    "save_attention_out": jax.checkpoint_policies.save_only_these_names(blockwise.RESIDUALS),
    # As `full`, but the one thing a layer keeps for its backward, its input, waits in host memory: at 229K tokens
    # per device the 32 saved inputs are 56 GiB of HBM, and moving 1.75 GiB per layer each way over PCIe costs
    # seconds against a step of many minutes.
    "full_offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_input"],
        offload_src="device", offload_dst="pinned_host"),
}


# The policies that save only a layer's input, which model.remat_group can save once per group of layers instead.
GROUPED_REMATS = ("full", "full_offload")


def _dtype(name: str):
  return jnp.dtype(name)


def reference_attention(q, k, v, segment_ids, positions):
  return kernels.reference(q, k, v, segment_ids, segment_ids, positions, positions)


class RMSNorm(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BTD):
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                       (x_BTD.shape[-1],), _dtype(self.cfg.param_dtype))
    x = x_BTD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.cfg.norm_eps)
    return (x * scale.astype(jnp.float32)).astype(_dtype(self.cfg.dtype))


def _weight(module: nn.Module, name: str, shape, names, std: float):
  """A parameter, cast to the compute dtype and gathered for use: its fsdp/context shards are all-gathered (after
  the cast, so half the bytes move in bf16) while its tensor sharding stays."""
  w = module.param(name, nn.with_logical_partitioning(nn.initializers.normal(std), names), shape,
                   _dtype(module.cfg.param_dtype))
  return constrain(w.astype(_dtype(module.cfg.dtype)), tuple("act_" + n for n in names))


class Attention(nn.Module):
  cfg: ModelConfig
  attention_fn: Callable

  @nn.compact
  def __call__(self, x_BTD, cos_BTF, sin_BTF, segment_ids, positions):
    c = self.cfg
    wq = _weight(self, "wq", (c.d_model, c.n_heads, c.head_dim), ("embed", "heads", "head_dim"), c.init_std)
    wk = _weight(self, "wk", (c.d_model, c.n_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), c.init_std)
    wv = _weight(self, "wv", (c.d_model, c.n_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), c.init_std)
    wo = _weight(self, "wo", (c.n_heads, c.head_dim, c.d_model), ("heads", "head_dim", "embed"), c.init_std)
    with jax.named_scope("qkv"):
      q_BTNH = rope.apply(jnp.einsum("btd,dnh->btnh", x_BTD, wq), cos_BTF, sin_BTF)
      k_BTKH = rope.apply(jnp.einsum("btd,dkh->btkh", x_BTD, wk), cos_BTF, sin_BTF)
      v_BTKH = jnp.einsum("btd,dkh->btkh", x_BTD, wv)
      q_BTNH = constrain(q_BTNH, ("batch", "seq", "act_heads", "act_head_dim"))
      k_BTKH = constrain(k_BTKH, ("batch", "seq", "act_kv_heads", "act_head_dim"))
      v_BTKH = constrain(v_BTKH, ("batch", "seq", "act_kv_heads", "act_head_dim"))
    with jax.named_scope(scopes.ATTENTION):
      out_BTNH = self.attention_fn(q_BTNH, k_BTKH, v_BTKH, segment_ids, positions)
    with jax.named_scope("out_proj"):
      return constrain(jnp.einsum("btnh,nhd->btd", out_BTNH, wo), ("batch", "seq", "act_embed"))


class MLP(nn.Module):
  """SwiGLU. With `mlp_chunk`, the tokens pass in strided steps (as the loss's do), each under its own remat, so
  only one step's [tokens, d_ff] activations exist at a time, in the forward and in the backward: at 229K local
  tokens and d_ff 14,336 each such array is 6 GiB in bfloat16, and a layer's backward holds several."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BTD):
    c = self.cfg
    w_gate = _weight(self, "w_gate", (c.d_model, c.d_ff), ("embed", "mlp"), c.init_std)
    w_up = _weight(self, "w_up", (c.d_model, c.d_ff), ("embed", "mlp"), c.init_std)
    w_down = _weight(self, "w_down", (c.d_ff, c.d_model), ("mlp", "embed"), c.init_std)
    B, T, D = x_BTD.shape
    chunk = loss_lib.global_chunk(c.mlp_chunk, T) if c.mlp_chunk else T
    if chunk >= T:
      return _swiglu(x_BTD, w_gate, w_up, w_down)
    steps = T // chunk
    # Token t = c·S + s: the chunk axis stays sharded like the sequence, so a step moves no activations.
    x_SBCD = jnp.moveaxis(x_BTD.reshape(B, chunk, steps, D), 2, 0)
    # The weights cross the scan in float32 so their gradients are summed over the steps in float32; each step
    # casts them back to the compute dtype. The cost: float32 copies of the gathered weights and of their gradient
    # sums, ~1.3 GiB per layer for Llama 3.1 8B without tensor parallelism.
    ws = tuple(w.astype(jnp.float32) for w in (w_gate, w_up, w_down))
    step = jax.checkpoint(lambda x, *w: _swiglu(x, *(wi.astype(x.dtype) for wi in w)), prevent_cse=False)
    y_SBCD = jax.lax.map(lambda x: step(x, *ws), x_SBCD)
    return constrain(jnp.moveaxis(y_SBCD, 0, 2).reshape(B, T, D), ("batch", "seq", "act_embed"))


def _swiglu(x_BTD, w_gate, w_up, w_down):
  gate_BTF = constrain(jnp.einsum("btd,df->btf", x_BTD, w_gate), ("batch", "seq", "act_mlp"))
  up_BTF = constrain(jnp.einsum("btd,df->btf", x_BTD, w_up), ("batch", "seq", "act_mlp"))
  return constrain(jnp.einsum("btf,fd->btd", nn.silu(gate_BTF) * up_BTF, w_down), ("batch", "seq", "act_embed"))


def saved_input(x_BTD, pieces: int = 1):
  """The layer's (or layer group's) input, named for the remat policies that save it. In `pieces` > 1 slices of the
  model width, each saved on its own: libtpu cannot copy 4 GiB or more to host memory at once (maxctx.trainer).
  `pieces` 0 leaves it unnamed: an enclosing remat's policy sees the names inside, so a layer within a remat group
  must not name its input, or every layer's would be saved after all."""
  if pieces == 0:
    return x_BTD
  if pieces == 1:
    return checkpoint_name(x_BTD, "layer_input")
  parts = jnp.split(x_BTD, pieces, axis=-1)
  return jnp.concatenate([checkpoint_name(p, "layer_input") for p in parts], axis=-1)


class Block(nn.Module):
  cfg: ModelConfig
  attention_fn: Callable
  offload_pieces: int = 1   # how its input is named for remat (saved_input); 0 inside a remat group

  @nn.compact
  def __call__(self, x_BTD, cos_BTF, sin_BTF, segment_ids, positions):
    x_BTD = saved_input(x_BTD, self.offload_pieces)
    with jax.named_scope("attention_block"):
      h = Attention(self.cfg, self.attention_fn, name="attn")(RMSNorm(self.cfg, name="attn_norm")(x_BTD),
                                                               cos_BTF, sin_BTF, segment_ids, positions)
      x_BTD = x_BTD + h
    with jax.named_scope("mlp_block"):
      x_BTD = x_BTD + MLP(self.cfg, name="mlp")(RMSNorm(self.cfg, name="mlp_norm")(x_BTD))
    return x_BTD, None


class Transformer(nn.Module):
  """tokens → final hidden states [B, T, D] (after the final norm). The output head `lm_head` is a parameter of this
  module, applied outside it: `token_loss` in training, `logits` for whole-vocabulary scores."""
  cfg: ModelConfig
  attention_fn: Callable | None = None
  offload_pieces: int = 1          # slices of a saved layer input copied to host one by one (saved_input)

  @nn.compact
  def __call__(self, tokens_BT, segment_ids_BT, positions_BT):
    c = self.cfg
    attention_fn = self.attention_fn or reference_attention
    embedding = self.param("embedding",
                           nn.with_logical_partitioning(nn.initializers.normal(c.init_std), ("vocab", "embed")),
                           (c.vocab_size, c.d_model), _dtype(c.param_dtype))
    with jax.named_scope("embed"):
      table_VD = constrain(embedding.astype(_dtype(c.dtype)), ("act_vocab", "act_embed"))
      x_BTD = constrain(jnp.take(table_VD, tokens_BT, axis=0), ("batch", "seq", "act_embed"))
    with jax.named_scope("rope"):
      inv_freq = rope.inv_frequencies(c.head_dim, c.rope_theta, c.rope_scaling, c.rope_factor,
                                      c.rope_low_freq_factor, c.rope_high_freq_factor, c.rope_original_context)
      cos_BTF, sin_BTF = rope.cos_sin(positions_BT, inv_freq, tokens_BT.shape[1] - 1)

    block = Block
    if c.remat != "none":
      block = nn.remat(Block, policy=REMAT_POLICIES[c.remat], prevent_cse=not c.scan_layers)
    args = (cos_BTF, sin_BTF, segment_ids_BT, positions_BT)
    if c.remat_group > 1 and c.scan_layers and c.remat in GROUPED_REMATS and not self.is_initializing():
      x_BTD = grouped_layers(c, attention_fn, self.offload_pieces, nn.unbox(self.variables["params"]["layers"]),
                             x_BTD, *args)
    elif c.scan_layers:
      stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(nn.broadcast,) * 4, length=c.n_layers,
                      metadata_params={nn.PARTITION_NAME: "layers"})
      x_BTD, _ = stack(c, attention_fn, self.offload_pieces, name="layers")(x_BTD, *args)
    else:
      for i in range(c.n_layers):
        x_BTD, _ = block(c, attention_fn, self.offload_pieces, name=f"layers_{i}")(x_BTD, *args)

    # Declared here so that `init` makes it; used by `head` below.
    self.param("lm_head", nn.with_logical_partitioning(nn.initializers.normal(c.init_std), ("embed", "vocab")),
               (c.d_model, c.vocab_size), _dtype(c.param_dtype))
    return RMSNorm(c, name="final_norm")(x_BTD)


def grouped_layers(c: ModelConfig, attention_fn: Callable, pieces: int, stacked, x_BTD, *args):
  """The scanned layers under `model.remat_group` g > 1 (nested remat): the forward saves only each group's input (to
  host memory under full_offload); the backward reruns the group's forward from it to recover its layers' inputs, and
  then each layer's backward reruns that layer as `full` does. The group's layers are a scan too, which reruns the
  group's last layer as well (a third forward of every layer, where g − 1 in g would do): unrolled, the compiler kept
  more alive (Llama 3.1 8B at 33,554,432 tokens on v5p-128 in pairs: 106.7 GiB per device unrolled, 84.8 scanned).
  The parameters stay stacked per layer, as `nn.scan` made them at init, and are only viewed as [groups, g, ...]
  here, so checkpoints and HF conversion do not depend on g."""
  g = c.remat_group
  groups = jax.tree.map(lambda p: p.reshape(c.n_layers // g, g, *p.shape[1:]), stacked)
  block = Block(c, attention_fn, offload_pieces=0, parent=None)   # a template applied per layer, not a child

  def layer(x, params):
    return block.apply({"params": params}, x, *args)

  layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)

  def group(x, params):
    x, _ = jax.lax.scan(layer, saved_input(x, pieces), params)
    return x, None

  group = jax.checkpoint(group, policy=REMAT_POLICIES[c.remat], prevent_cse=False)
  with jax.named_scope("layer_groups"):
    return jax.lax.scan(group, x_BTD, groups)[0]


def head(params) -> jax.Array:
  """The output projection [D, V], gathered for use in its stored dtype: the chunked loss casts it per step and sums
  its gradient in float32 over the steps."""
  return constrain(params["lm_head"], ("act_embed", "act_vocab"))


def logits(params, x_BTD) -> jax.Array:
  """Float32 scores over the whole vocabulary for every token: [B, T, V] (for short sequences; see token_loss)."""
  with jax.named_scope("logits"):
    w_DV = head(params)
    return jnp.einsum("btd,dv->btv", x_BTD, w_DV.astype(x_BTD.dtype), preferred_element_type=jnp.float32)


def token_loss(cfg: ModelConfig, params, x_BTD, targets_BT, segment_ids_BT) -> tuple[jax.Array, jax.Array]:
  """(summed cross-entropy of the tokens that belong to a document, their count), float32, from the final hidden
  states; the [T, V] logits are never all held (maxctx.model.loss)."""
  with jax.named_scope("loss"):
    chunk = loss_lib.global_chunk(cfg.loss_chunk, x_BTD.shape[1])
    weights_BT = (segment_ids_BT != 0).astype(jnp.float32)
    return loss_lib.chunked_cross_entropy(x_BTD, head(params), targets_BT, weights_BT, chunk)
