"""maxctx's decoder against transformers' LlamaForCausalLM on the same random weights, and the HF conversion round trip.

Acceptance (issue 2): float32 logits within 1e-4 for MHA, GQA 4:1 and llama3 RoPE scaling, with either layer layout.
The weights are drawn with std 0.2 (norm scales around 1) so logits are O(1) and a wrong layout cannot hide.
"""

from __future__ import annotations

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxctx import config as config_lib
from maxctx import convert, hf
from maxctx.errors import CheckpointError, ConfigError
from maxctx import model
from maxctx.model import Transformer, rope

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
SEQ = 192  # longer than the llama3 original context below, so the scaled frequencies matter.
ORIGINAL_CONTEXT = 64


def hf_config(n_kv_heads: int, scaling: bool):
  rope_scaling = None
  if scaling:
    rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": ORIGINAL_CONTEXT}
  return transformers.LlamaConfig(
      vocab_size=256, hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
      num_key_value_heads=n_kv_heads, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5,
      rope_theta=500000.0, rope_scaling=rope_scaling, tie_word_embeddings=False, attn_implementation="eager")


def random_hf_model(n_kv_heads: int, scaling: bool, seed: int = 0):
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(hf_config(n_kv_heads, scaling)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(1.0 if "norm" in name else 0.0, 0.2)
  return model


def state_dict_np(model) -> dict[str, np.ndarray]:
  return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def maxctx_config(hf_cfg: dict, scan_layers: bool):
  overrides = hf.model_config_from_hf(hf_cfg)
  overrides.update({"model.scan_layers": scan_layers, "model.remat": "none", "model.dtype": "float32",
                    "model.param_dtype": "float32"})
  return config_lib.load(None).replace(**overrides).model


def tokens(batch: int = 2, seq: int = SEQ) -> np.ndarray:
  return np.random.default_rng(1).integers(0, 256, (batch, seq)).astype(np.int32)


def hf_logits(model, tokens_BT: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens_BT).long()).logits.numpy()


def maxctx_logits(params, cfg, tokens_BT: np.ndarray) -> np.ndarray:
  positions = np.broadcast_to(np.arange(tokens_BT.shape[1], dtype=np.int32), tokens_BT.shape)
  @jax.jit
  def apply(params, tokens_BT, segment_ids_BT, positions_BT):
    return model.logits(params, Transformer(cfg).apply({"params": params}, tokens_BT, segment_ids_BT, positions_BT))
  return np.asarray(apply(params, tokens_BT, np.ones_like(tokens_BT), positions))


def assert_tree_like_init(params, cfg):
  """params_from_hf fills exactly the tree Transformer.init makes: same paths, shapes and dtypes."""
  t = jnp.zeros((1, 8), jnp.int32)
  abstract = jax.eval_shape(lambda: nn.unbox(Transformer(cfg).init(jax.random.key(0), t, t, t)["params"]))
  got = jax.tree.map(lambda x: (x.shape, np.dtype(x.dtype)), params)
  want = jax.tree.map(lambda x: (x.shape, np.dtype(x.dtype)), abstract)
  assert got == want


def test_llama3_scaling_changes_the_test_frequencies():
  """Guards the parity test's power: with these settings llama3 scaling moves some frequencies and keeps others."""
  plain = rope.inv_frequencies(16, 500000.0)
  scaled = rope.inv_frequencies(16, 500000.0, True, 8.0, 1.0, 4.0, ORIGINAL_CONTEXT)
  changed = ~np.isclose(plain, scaled, rtol=1e-6)
  assert changed.any() and not changed.all()
  interpolated = changed & ~np.isclose(plain / 8.0, scaled, rtol=1e-6)
  assert interpolated.any()  # the smooth band between high and low frequencies is exercised too.


@pytest.mark.parametrize("n_kv_heads,scaling", [(4, False), (1, False), (1, True), (2, True)],
                         ids=["mha", "gqa4to1", "gqa4to1-llama3", "gqa2to1-llama3"])
@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_logits_match_transformers(n_kv_heads, scaling, scan_layers):
  model = random_hf_model(n_kv_heads, scaling)
  sd = state_dict_np(model)
  cfg = maxctx_config(model.config.to_dict(), scan_layers)
  assert cfg.rope_scaling == scaling and cfg.n_kv_heads == n_kv_heads
  params = hf.params_from_hf(sd, cfg)
  assert_tree_like_init(params, cfg)

  t = tokens()
  want = hf_logits(model, t)
  got = maxctx_logits(params, cfg, t)
  assert np.abs(want).max() > 1.0  # logits are not trivially small
  err = np.abs(got - want).max()
  assert err <= TOL, f"max abs logit error {err:.2e}"

  roundtrip = hf.hf_from_params(params, cfg)
  assert roundtrip.keys() == sd.keys()
  for name, w in sd.items():
    assert roundtrip[name].dtype == w.dtype and np.array_equal(roundtrip[name], w), name

  if scaling:
    # The comparison sees RoPE scaling: the same weights with it off are far from HF's logits.
    plain = maxctx_logits(params, dataclasses.replace(cfg, rope_scaling=False), t)
    assert np.abs(plain - want).max() > 100 * TOL


def test_hf_config_round_trip():
  original = hf.model_config_from_hf(hf_config(1, True).to_dict())  # transformers 5's rope_parameters layout
  exported = hf.hf_config_from_model(config_lib.load(None).replace(**original).model)  # the Hub's rope_scaling layout
  assert hf.model_config_from_hf(exported) == original
  assert hf.model_config_from_hf(transformers.LlamaConfig.from_dict(exported).to_dict()) == original


def test_llama31_hub_config_gives_the_preset():
  """meta-llama/Llama-3.1-8B's config.json (no head_dim key: it is hidden_size / heads) maps onto configs/models."""
  hub = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
         "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
         "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
         "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
         "pretraining_tp": 1, "rms_norm_eps": 1e-05,
         "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"},
         "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
         "vocab_size": 128256}
  preset = config_lib.load(None, ["model.preset=llama3.1-8b"])
  assert preset.replace(**hf.model_config_from_hf(hub)) == preset


@pytest.mark.parametrize("change,match", [
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"model_type": "mistral"}, "model_type"),
])
def test_unsupported_hf_configs_are_refused(change, match):
  base = hf.hf_config_from_model(config_lib.load(None, ["model.preset=tiny"]).model)
  with pytest.raises(ConfigError, match=match):
    hf.model_config_from_hf({**base, **change})


def test_missing_and_misshaped_tensors_name_the_tensor():
  model = random_hf_model(1, False)
  sd = state_dict_np(model)
  cfg = maxctx_config(model.config.to_dict(), True)
  name = "model.layers.1.self_attn.k_proj.weight"
  with pytest.raises(CheckpointError, match=rf"lacks tensor {name}"):
    hf.params_from_hf({k: v for k, v in sd.items() if k != name}, cfg)
  with pytest.raises(CheckpointError, match=rf"{name} has shape \(32, 64\) but the model config needs \(16, 64\)"):
    hf.params_from_hf({**sd, name: np.zeros((32, 64), np.float32)}, cfg)
  with pytest.raises(CheckpointError, match="model.layers.2.mlp.up_proj.weight"):
    hf.params_from_hf({**sd, "model.layers.2.mlp.up_proj.weight": sd["model.layers.1.mlp.up_proj.weight"]}, cfg)
  params = hf.params_from_hf(sd, cfg)
  params["layers"]["attn"]["wo"] = params["layers"]["attn"]["wo"][:1]
  with pytest.raises(CheckpointError, match=r"layers/attn/wo has shape \(1, 4, 16, 64\)"):
    hf.hf_from_params(params, cfg)


def test_convert_round_trip(tmp_path, monkeypatch):
  """save_pretrained → maxctx.convert import → maxctx logits = HF; export → from_pretrained → logits unchanged; the
  sharded export imports again to the same params, bit for bit."""
  monkeypatch.setattr(convert, "SHARD_BYTES", 64 * 1024)  # export writes shards and an index, as for a real model.
  model = random_hf_model(1, True, seed=3)
  model.save_pretrained(tmp_path / "hf", safe_serialization=True)
  t = tokens(1, 128)
  want = hf_logits(model, t)

  convert.import_hf(tmp_path / "hf", tmp_path / "maxctx")
  run = config_lib.load(tmp_path / "maxctx" / "model.yml", ["model.dtype=float32"])
  cfg = run.model
  params = convert.read_params(tmp_path / "maxctx" / "params", run)
  err_import = np.abs(maxctx_logits(params, cfg, t) - want).max()
  assert err_import <= TOL, f"imported: max abs logit error {err_import:.2e}"

  convert.export_hf(tmp_path / "maxctx" / "params", tmp_path / "maxctx" / "model.yml", tmp_path / "hf_out")
  assert json.loads((tmp_path / "hf_out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
  exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf_out", attn_implementation="eager",
                                                           dtype=torch.float32).eval()
  err_export = np.abs(hf_logits(exported, t) - want).max()
  assert err_export <= TOL, f"exported: max abs logit error {err_export:.2e}"
  assert all(np.array_equal(w, state_dict_np(model)[k]) for k, w in state_dict_np(exported).items())

  assert len(list((tmp_path / "hf_out").glob("*.safetensors"))) > 1
  convert.import_hf(tmp_path / "hf_out", tmp_path / "again", scan_layers=False)
  unscanned = config_lib.load(tmp_path / "again" / "model.yml", ["model.dtype=float32"])
  again = convert.read_params(tmp_path / "again" / "params", unscanned)
  assert "layers_1" in again
  assert jax.tree.all(jax.tree.map(np.array_equal, hf.hf_from_params(again, cfg), hf.hf_from_params(params, cfg)))
