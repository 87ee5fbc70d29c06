"""Training starts from an imported Hugging Face model: `python -m maxctx.convert import` then
`checkpoint.load_params=<out>`.

Acceptance (issue 5, item 5): the first training loss equals the loss transformers' logits give on the same batch,
and parameters that do not fit the model are refused with a sentence naming the parameter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from maxctx import config, convert, data, hf, mesh as mesh_lib, train
from maxctx.attention import layout
from maxctx.errors import CheckpointError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  """A random tiny HF Llama saved with save_pretrained, and its `python -m maxctx.convert import` output directory
  (the command as a user runs it)."""
  root = tmp_path_factory.mktemp("hf")
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(
      vocab_size=512, hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
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
      f"run.output_dir={out_dir}", f"checkpoint.load_params={imported_dir}", "run.steps=1", "data.seq_len=64",
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
