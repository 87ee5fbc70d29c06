"""The analytic FLOPs behind MFU agree with what XLA counts in the compiled train step."""

import jax
import jax.numpy as jnp
import pytest

from maxctx import config, mesh as mesh_lib, metrics
from maxctx.trainer import Trainer

B, T = 8, 64


def test_analytic_flops_match_xla_cost_analysis():
  # XLA's cost analysis counts a while loop's body once, so layers are unrolled and the loss is one chunk here; a
  # dense config (attention a small share) because the reference kernel does the masked half of T² as well.
  c = config.load(None, [
      "model.preset=tiny", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=4", "model.head_dim=64",
      "model.d_ff=1024", "model.n_layers=2", "model.scan_layers=false", "model.vocab_size=1024",
      f"model.loss_chunk={T}", f"data.seq_len={T}", f"data.batch_size={B}", "mesh.ici.fsdp=1",
      "attention.kernel=reference"])
  mesh = mesh_lib.build_mesh(c.mesh, jax.devices()[:1])
  with jax.set_mesh(mesh):
    trainer = Trainer(c, mesh)
    state = trainer.abstract_state()
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32) for k in ("tokens", "targets", "segment_ids", "positions")}
    xla_flops = trainer.step.lower(state, batch).compile().cost_analysis()["flops"]
  analytic = metrics.flops_per_step(c.model, B, T)
  assert analytic == pytest.approx(xla_flops, rel=0.10)


def test_flops_of_llama_8b_at_14m_tokens_are_attention_dominated():
  m = config.load(None, ["model.preset=llama3.1-8b"]).model
  total = metrics.flops_per_step(m, 1, 14_680_064)
  weights = 6.0 * metrics.matmul_params(m) * 14_680_064
  assert total == pytest.approx(1.7e20, rel=0.1)  # design.md's figure
  assert (total - weights) / total > 0.99


def test_peak_memory_is_the_largest_device_peak_and_absent_where_the_runtime_does_not_count(monkeypatch):
  """The step line's "peak X GiB" (GPU/TPU): the most any local device has held; on the CPU, whose devices keep no
  memory statistics, nothing rather than a made-up 0."""
  class Device:
    def __init__(self, stats):
      self.stats = stats

    def memory_stats(self):
      return self.stats

  monkeypatch.setattr(metrics.jax, "local_devices",
                      lambda: [Device({"peak_bytes_in_use": 3 * 2**30}), Device({"peak_bytes_in_use": 5 * 2**29})])
  assert metrics.peak_memory_gib() == 3.0
  monkeypatch.setattr(metrics.jax, "local_devices", lambda: [Device(None), Device({})])
  assert metrics.peak_memory_gib() is None
