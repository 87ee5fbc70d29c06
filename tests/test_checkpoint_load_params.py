"""Training starts from an imported Hugging Face model: `python -m maxctx.convert import` then
`checkpoint.load_params=<out>`.

Acceptance (issue 5, item 5): the first training loss equals the loss transformers' logits give on the same batch,
and parameters that do not fit the model are refused with a sentence naming the parameter. Issue 35, item 6: a run
that extends the imported model's context with new RoPE settings exports a model whose logits transformers
reproduces at the new length.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from maxctx import config, convert, data, hf, mesh as mesh_lib, model as model_lib, params_io, stages, train
from maxctx.attention import layout
from maxctx.convert.__main__ import main as convert_main
from maxctx.errors import CheckpointError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HF_CONTEXT = 64   # the HF model's max_position_embeddings, the length it was "pre-trained" at
THETA = 10000.0

@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  """A random tiny HF Llama saved with save_pretrained, and its `python -m maxctx.convert import` output directory
  (the command as a user runs it)."""
  root = tmp_path_factory.mktemp("hf")
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(
      vocab_size=512, hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, max_position_embeddings=HF_CONTEXT, rms_norm_eps=1e-5, rope_theta=THETA,
      rope_scaling=None, tie_word_embeddings=False, attn_implementation="eager")
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(1.0 if "norm" in name else 0.0, 0.1)
  model.save_pretrained(root / "hf", safe_serialization=True)
  subprocess.run([sys.executable, "-m", "maxctx.convert", "import", str(root / "hf"), str(root / "maxctx")],
                 check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, timeout=300)
  return model, root / "maxctx"


def _config(out_dir, imported_dir, *overrides):
  model = hf.model_config_from_hf(json.loads((imported_dir.parent / "hf" / "config.json").read_text()))
  return config.load("configs/demo.yml", [
      f"run.output_dir={out_dir}", f"checkpoint.load_params={imported_dir}", "run.steps=1", f"data.seq_len={HF_CONTEXT}",
      "model.dtype=float32", "attention.kernel=reference", "metrics.tensorboard=false",
      *[f"{k}={v}" for k, v in model.items()], *overrides])


def _hf_loss(model, batch) -> float:
  """Mean next-token loss of `batch` from transformers' logits, one packed document at a time."""
  total, count = 0.0, 0
  for row in range(batch["tokens"].shape[0]):
    seg = batch["segment_ids"][row]
    for s in np.unique(seg[seg > 0]):
      where = seg == s
      assert np.array_equal(batch["positions"][row][where], np.arange(where.sum()))
      with torch.no_grad():
        logits = model(torch.from_numpy(batch["tokens"][row][where][None].astype(np.int64))).logits[0].double()
      targets = torch.from_numpy(batch["targets"][row][where].astype(np.int64))
      total += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
      count += int(where.sum())
  return total / count


def test_training_starts_from_imported_hf_weights_and_exports_back(tmp_path, imported):
  model, out = imported
  c = _config(tmp_path / "run", out, "run.steps=2", "checkpoint.every_steps=2")  # Step 1's warm-up rate is 0.
  mesh = mesh_lib.build_mesh(c.mesh)
  with jax.set_mesh(mesh):
    batch = jax.device_get(next(data.build(c, mesh)))
  if c.attention.load_balance:  # Back to token order, where each document is contiguous.
    batch = {k: layout.unzigzag(v, mesh.shape["context"]) for k, v in batch.items()}
  want = _hf_loss(model, batch)
  first, _ = train.run(c)
  assert first == pytest.approx(want, abs=1e-4), (first, want)
  # A random init would sit near ln(vocab) instead.
  assert abs(want - np.log(c.model.vocab_size)) > 0.05

  # The trained step exports back to a directory transformers loads, holding the checkpoint's parameters.
  state_dir = tmp_path / "run" / "checkpoints" / "2" / "state"
  convert.export_hf(state_dir, tmp_path / "run" / "config.yml", tmp_path / "hf_out")
  trained = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf_out").eval()
  want = hf.hf_from_params(convert.read_params(state_dir, c), c.model)
  got = {k: v.detach().numpy() for k, v in trained.state_dict().items()}
  for name, w in want.items():
    np.testing.assert_array_equal(got[name], w)
  assert not np.array_equal(got["lm_head.weight"], model.state_dict()["lm_head.weight"].numpy())  # It trained.


def test_load_params_that_do_not_fit_the_model_name_the_parameter(tmp_path, imported):
  _, out = imported
  with pytest.raises(CheckpointError, match=r"checkpoint.load_params \S+/params holds parameter layers.mlp.w_\w+ with "
                                            r"shape \(2, 128, 64\), but the model needs \(2, 96, 64\)"):
    train.run(_config(tmp_path, out, "model.d_ff=96"))
  with pytest.raises(CheckpointError, match=r"has no parameter layers_0.attn.wk \(shape \(64, 2, 16\)\), which the "
                                            r"model has"):
    train.run(_config(tmp_path, out, "model.scan_layers=false"))


def _maxctx_logits(params, cfg, tokens_BT: np.ndarray) -> np.ndarray:
  positions = np.broadcast_to(np.arange(tokens_BT.shape[1], dtype=np.int32), tokens_BT.shape)
  @jax.jit
  def apply(params, tokens_BT, segment_ids_BT, positions_BT):
    x_BTD = model_lib.Transformer(cfg).apply({"params": params}, tokens_BT, segment_ids_BT, positions_BT)
    return model_lib.logits(params, x_BTD)
  return np.asarray(apply(params, tokens_BT, np.ones_like(tokens_BT), positions))


def test_context_extension_run_exports_a_model_transformers_reproduces_at_the_new_length(tmp_path, imported):
  """import → a two-stage run (checkpoint.load_params from the import): a step at the HF model's context, then one at
  4× it with a 4× RoPE base and llama3 scaling from that context → `python -m maxctx.convert export` of its last step → transformers loads
  it, and its float32 logits at the new length equal maxctx's on the same parameters within the parity test's 1e-4."""
  hf_model, out = imported
  new_len = 4 * HF_CONTEXT
  rope_keys = {"rope_theta": 4 * THETA, "rope_scaling": True, "rope_factor": 4.0, "rope_low_freq_factor": 1.0,
               "rope_high_freq_factor": 4.0, "rope_original_context": HF_CONTEXT}
  # Two stages: one step at the imported context and RoPE, one at 4× the length with the new RoPE (run.stages).
  stage2 = ", ".join([f"data.seq_len: {new_len}", *[f"model.{k}: {v}" for k, v in rope_keys.items()]])
  c = _config(tmp_path / "run", out, "run.steps=2", "checkpoint.every_steps=2",
              f"run.stages=[{{steps: 1}}, {{steps: 1, {stage2}}}]")
  train.run(c)
  c = stages.stage_config(c, 2)   # the stage that made step 2
  assert c.data.seq_len == new_len and c.model.rope_theta == 4 * THETA
  step = tmp_path / "run" / "checkpoints" / "2"
  # Export takes the RoPE settings of the run stage (run.stages) that made this many steps.
  assert params_io.steps_done(str(step)) == params_io.steps_done(str(step / "state")) == 2
  assert params_io.steps_done(str(out)) == 0
  assert convert_main(["export", str(step), str(tmp_path / "run" / "config.yml"), str(tmp_path / "hf_out")]) == 0

  written = json.loads((tmp_path / "hf_out" / "config.json").read_text())
  assert written["rope_theta"] == 4 * THETA and written["max_position_embeddings"] >= new_len
  assert written["rope_scaling"] == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": HF_CONTEXT}
  exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf_out", attn_implementation="eager",
                                                           dtype=torch.float32).eval()
  tokens = np.random.default_rng(1).integers(0, c.model.vocab_size, (2, new_len)).astype(np.int32)
  with torch.no_grad():
    want = exported(torch.from_numpy(tokens).long()).logits.numpy()
  params = convert.read_params(step, c)
  err = np.abs(_maxctx_logits(params, c.model, tokens) - want).max()
  assert err <= 1e-4, f"max abs logit error {err:.2e} at {new_len} tokens"

  # The comparison sees the RoPE change: the same parameters under the imported settings, or without the scaling,
  # are far from transformers' logits.
  for before in ({"rope_theta": THETA, "rope_scaling": False}, {"rope_scaling": False}):
    stale = _maxctx_logits(params, dataclasses.replace(c.model, **before), tokens)
    assert np.abs(stale - want).max() > 100 * 1e-4, before
  assert not np.array_equal(exported.state_dict()["lm_head.weight"].numpy(),
                            hf_model.state_dict()["lm_head.weight"].numpy())   # it trained
