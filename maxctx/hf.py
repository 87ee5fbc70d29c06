"""Hugging Face Llama ↔ maxctx: the config keys and the weight layout, both ways, as numpy.

Dimension letters as in maxctx.model.transformer: V vocab, D model, L layers, N query heads, K KV heads, H head dim,
F MLP width.

HF stores every projection as a torch Linear weight `[out, in]` and computes `x @ W.T`; maxctx stores `[in, out]` with
the head axes split out, so the mapping is a transpose and a reshape. Neither side permutes q/k for RoPE: HF's own
format and maxctx both rotate the two halves of the head dimension (the interleave↔halves permutation exists only
in HF's converter from Meta's original checkpoints), which tests/test_hf_parity.py checks against transformers.

`maxctx.convert` uses these to import and export checkpoints on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import ml_dtypes
import numpy as np

from maxctx.config import ModelConfig
from maxctx.errors import CheckpointError, ConfigError

# Keys a HF state dict may carry that hold no weights (old checkpoints saved RoPE's buffer per layer).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

# HF LlamaConfig defaults for keys a config.json may leave out.
_HF_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
                "attention_bias": False, "mlp_bias": False}


# ---------------------------------------------------------------------------------------------------------------------
# Config.


def _rope_parameters(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
  """(rope_theta, llama3 scaling dict or None) from either config.json generation.

  transformers < 5 (and the Llama 3.1 Hub files) write `rope_theta` and `rope_scaling`; transformers 5 writes one
  `rope_parameters` dict that also holds rope_theta.
  """
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  theta = float(params.get("rope_theta", hf.get("rope_theta", _HF_DEFAULTS["rope_theta"])))
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type == "default":
    return theta, None
  if rope_type != "llama3":
    raise ConfigError(f"HF config rope type {rope_type!r} is not supported; maxctx implements plain RoPE and llama3 "
                      "scaling only, so convert a model whose rope_scaling is null or has rope_type 'llama3'.")
  for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
    if key not in params:
      raise ConfigError(f"HF config llama3 rope scaling lacks {key!r}; add it to rope_scaling in config.json.")
  return theta, params


def model_config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """config.json of a HF Llama → dotted `model.*` overrides, refusing what maxctx's decoder cannot represent."""
  model_type = hf.get("model_type", "llama")
  if model_type != "llama":
    raise ConfigError(f"HF config model_type is {model_type!r}; only 'llama' checkpoints (LlamaForCausalLM) convert.")
  refuse = {
      "tie_word_embeddings": "maxctx keeps a separate lm_head; untie the embeddings (copy embed_tokens into lm_head)",
      "attention_bias": "maxctx's attention projections have no bias",
      "mlp_bias": "maxctx's MLP projections have no bias",
  }
  for key, why in refuse.items():
    if hf.get(key, _HF_DEFAULTS[key]):
      raise ConfigError(f"HF config sets {key}: true, which maxctx does not support ({why}).")
  if hf.get("hidden_act", "silu") != "silu":
    raise ConfigError(f"HF config hidden_act is {hf['hidden_act']!r}; maxctx's MLP is SwiGLU, so only 'silu' converts.")
  for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
    if key not in hf:
      raise ConfigError(f"HF config lacks {key!r}; a Llama config.json needs it to describe the model.")

  n_heads = int(hf["num_attention_heads"])
  head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
  theta, scaling = _rope_parameters(hf)
  out = {
      "model.vocab_size": int(hf["vocab_size"]),
      "model.d_model": int(hf["hidden_size"]),
      "model.n_layers": int(hf["num_hidden_layers"]),
      "model.n_heads": n_heads,
      "model.n_kv_heads": int(hf.get("num_key_value_heads") or n_heads),
      "model.head_dim": int(head_dim),
      "model.d_ff": int(hf["intermediate_size"]),
      "model.norm_eps": float(hf.get("rms_norm_eps", _HF_DEFAULTS["rms_norm_eps"])),
      "model.rope_theta": theta,
      "model.rope_scaling": scaling is not None,
  }
  if scaling is not None:
    out.update({
        "model.rope_factor": float(scaling["factor"]),
        "model.rope_low_freq_factor": float(scaling["low_freq_factor"]),
        "model.rope_high_freq_factor": float(scaling["high_freq_factor"]),
        "model.rope_original_context": int(scaling["original_max_position_embeddings"]),
    })
  return out


# Llama 3.1's context, the least max_position_embeddings an export claims (RoPE has no table to size, so it is not a
# maxctx setting; transformers only warns when the llama3 original context is not below it).
MAX_POSITION_EMBEDDINGS = 131072


def hf_config_from_model(cfg: ModelConfig, max_position_embeddings: int = MAX_POSITION_EMBEDDINGS,
                         dtype: str | None = None) -> dict[str, Any]:
  """config.json content for a LlamaForCausalLM with `cfg`'s dimensions and RoPE settings.

  Written in the transformers 4 / Hub layout (top-level rope_theta, rope_scaling), which transformers 5 also reads.
  """
  rope_scaling = None
  if cfg.rope_scaling:
    rope_scaling = {"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                    "high_freq_factor": cfg.rope_high_freq_factor,
                    "original_max_position_embeddings": cfg.rope_original_context}
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim,
      "intermediate_size": cfg.d_ff,
      "hidden_act": "silu",
      "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": rope_scaling,
      "max_position_embeddings": max_position_embeddings,
      "tie_word_embeddings": False,
      "attention_bias": False,
      "mlp_bias": False,
      "torch_dtype": dtype or cfg.param_dtype,
  }


# ---------------------------------------------------------------------------------------------------------------------
# Weights.


class _Spec(NamedTuple):
  path: tuple[str, ...]  # inside a layer for per-layer tensors
  hf_name: str  # inside model.layers.{i}. for per-layer tensors
  hf_shape: tuple[int, ...]
  shape: tuple[int, ...]
  to_maxctx: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]


def _same(w):
  return w


def _linear(w):  # torch Linear [out, in] ↔ [in, out]
  return w.T


def _layer_specs(cfg: ModelConfig) -> list[_Spec]:
  D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
  return [
      _Spec(("attn", "wq"), "self_attn.q_proj.weight", (N * H, D), (D, N, H),
            lambda w: w.T.reshape(D, N, H), lambda w_DNH: w_DNH.reshape(D, N * H).T),
      _Spec(("attn", "wk"), "self_attn.k_proj.weight", (K * H, D), (D, K, H),
            lambda w: w.T.reshape(D, K, H), lambda w_DKH: w_DKH.reshape(D, K * H).T),
      _Spec(("attn", "wv"), "self_attn.v_proj.weight", (K * H, D), (D, K, H),
            lambda w: w.T.reshape(D, K, H), lambda w_DKH: w_DKH.reshape(D, K * H).T),
      _Spec(("attn", "wo"), "self_attn.o_proj.weight", (D, N * H), (N, H, D),
            lambda w: w.T.reshape(N, H, D), lambda w_NHD: w_NHD.reshape(N * H, D).T),
      _Spec(("mlp", "w_gate"), "mlp.gate_proj.weight", (F, D), (D, F), _linear, _linear),
      _Spec(("mlp", "w_up"), "mlp.up_proj.weight", (F, D), (D, F), _linear, _linear),
      _Spec(("mlp", "w_down"), "mlp.down_proj.weight", (D, F), (F, D), _linear, _linear),
      _Spec(("attn_norm", "scale"), "input_layernorm.weight", (D,), (D,), _same, _same),
      _Spec(("mlp_norm", "scale"), "post_attention_layernorm.weight", (D,), (D,), _same, _same),
  ]


def _top_specs(cfg: ModelConfig) -> list[_Spec]:
  V, D = cfg.vocab_size, cfg.d_model
  return [
      _Spec(("embedding",), "model.embed_tokens.weight", (V, D), (V, D), _same, _same),
      _Spec(("final_norm", "scale"), "model.norm.weight", (D,), (D,), _same, _same),
      _Spec(("lm_head",), "lm_head.weight", (V, D), (D, V), _linear, _linear),
  ]


def _np_dtype(name: str) -> np.dtype:
  # numpy has no bfloat16 of its own; ml_dtypes (installed with jax) provides the one jax and safetensors use.
  return np.dtype(getattr(ml_dtypes, name)) if name == "bfloat16" else np.dtype(name)


def _fetch(state_dict: Mapping[str, Any], name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  if name not in state_dict:
    raise CheckpointError(f"HF checkpoint lacks tensor {name} (expected shape {shape}); check that the checkpoint "
                          "is complete and matches config.json.")
  w = np.asarray(state_dict[name])
  if w.shape != shape:
    raise CheckpointError(f"HF tensor {name} has shape {w.shape} but the model config needs {shape}; check that "
                          "config.json belongs to these weights.")
  return w.astype(dtype, copy=False)


def _put(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...], shape: tuple[int, ...]) -> np.ndarray:
  node = tree
  for key in path:
    if not isinstance(node, Mapping) or key not in node:
      raise CheckpointError(f"maxctx params lack {'/'.join(path)}; the checkpoint does not hold a maxctx "
                            "Transformer's parameters.")
    node = node[key]
  w = np.asarray(node)
  if w.shape != shape:
    raise CheckpointError(f"maxctx param {'/'.join(path)} has shape {w.shape} but the model config needs {shape}; "
                          "pass the model config the checkpoint was trained with.")
  return w


def params_from_hf(state_dict: Mapping[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  """A HF Llama state dict (name → array, e.g. lazily read from safetensors) → maxctx params for `cfg`.

  The result is a plain nested dict of numpy arrays in `cfg.param_dtype`, laid out for `cfg.scan_layers`: stacked
  along a leading L axis under 'layers', or one 'layers_{i}' subtree per block. Tensors are read one at a time, so a
  lazy mapping keeps peak memory near the size of the result.
  """
  dtype = _np_dtype(cfg.param_dtype)
  known = set()
  params: dict[str, Any] = {}
  for s in _top_specs(cfg):
    known.add(s.hf_name)
    _put(params, s.path, np.ascontiguousarray(s.to_maxctx(_fetch(state_dict, s.hf_name, s.hf_shape, dtype))))

  for s in _layer_specs(cfg):
    per_layer = []
    for i in range(cfg.n_layers):
      name = f"model.layers.{i}.{s.hf_name}"
      known.add(name)
      per_layer.append(s.to_maxctx(_fetch(state_dict, name, s.hf_shape, dtype)))
    if cfg.scan_layers:
      _put(params, ("layers",) + s.path, np.stack(per_layer))
    else:
      for i, w in enumerate(per_layer):
        _put(params, (f"layers_{i}",) + s.path, np.ascontiguousarray(w))

  unexpected = sorted(k for k in state_dict if k not in known and not k.endswith(_IGNORED_SUFFIXES))
  if unexpected:
    more = f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
    raise CheckpointError(f"HF checkpoint has tensors maxctx has no place for: {', '.join(unexpected[:3])}{more}; "
                          "it is not a plain Llama checkpoint matching config.json (e.g. more layers, or biases).")
  return params


def hf_from_params(params: Mapping[str, Any], cfg: ModelConfig, dtype: str | None = None) -> dict[str, np.ndarray]:
  """maxctx params (boxed or not, jax or numpy, scanned or per-layer) → a HF Llama state dict of numpy arrays.

  The layer layout is read from the tree itself, so a checkpoint written with either `scan_layers` exports.
  `dtype` casts every tensor (e.g. "bfloat16" to halve the files); by default they keep the params' dtype.
  """
  params = nn.unbox(params)
  cast = None if dtype is None else _np_dtype(dtype)

  def finish(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w if cast is None else w.astype(cast))

  out: dict[str, np.ndarray] = {}
  for s in _top_specs(cfg):
    out[s.hf_name] = finish(s.to_hf(_get(params, s.path, s.shape)))
  scanned = "layers" in params
  for s in _layer_specs(cfg):
    if scanned:
      stacked = _get(params, ("layers",) + s.path, (cfg.n_layers,) + s.shape)
    for i in range(cfg.n_layers):
      w = stacked[i] if scanned else _get(params, (f"layers_{i}",) + s.path, s.shape)
      out[f"model.layers.{i}.{s.hf_name}"] = finish(s.to_hf(w))
  return out
