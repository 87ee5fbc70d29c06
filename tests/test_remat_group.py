"""model.remat_group: nested remat over groups of scanned layers (how 33,554,432 tokens fit 64 v5p chips). A group
saves only its input, to host memory under full_offload, in slices of the model width when one copy would be 4 GiB
or more; the numbers are those of plain remat; and what a run may ask of it is checked before compiling."""

import contextlib
import io
import re

import jax
import numpy as np
import pytest

from maxctx import config, mesh as mesh_lib, trainer
from maxctx.errors import ConfigError

LAYERS, TOKENS, BATCH = 4, 256, 2


def _config(*overrides):
  return config.load("configs/demo.yml", [
      f"data.seq_len={TOKENS}", f"data.batch_size={BATCH}", "mesh.ici.fsdp=1", "mesh.ici.context=8",
      "model.dtype=float32", "attention.load_balance=false", f"model.n_layers={LAYERS}", *overrides])


def _batch():
  tokens = np.random.default_rng(0).integers(1, 500, (BATCH, TOKENS)).astype(np.int32)
  return {"tokens": tokens, "targets": np.roll(tokens, -1, 1), "segment_ids": np.ones_like(tokens),
          "positions": np.tile(np.arange(TOKENS, dtype=np.int32), (BATCH, 1))}


def _loss_fn(overrides, pieces=None):
  """(loss of the params, the params) of the tiny model on a ring over 8 devices, with `pieces` forced."""
  c = _config(*overrides)
  trainer.validate(c, 8)
  mesh = mesh_lib.build_mesh(c.mesh)
  t = trainer.Trainer(c, mesh)
  if pieces:
    t.model = t.model.clone(offload_pieces=pieces)
  batch = _batch()
  with jax.set_mesh(mesh):
    params = t.init(jax.random.key(0)).params
  return (lambda p: t.loss_sum(p, batch)[0]), params, mesh


@pytest.fixture(scope="module")
def plain():
  loss, params, mesh = _loss_fn(["model.remat=full"])
  with jax.set_mesh(mesh):
    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("overrides, pieces", [
    (["model.remat=full", "model.remat_group=2"], None),
    # four layers in one group, each saved input in two slices of the width (as 4 GiB inputs are on a TPU)
    (["model.remat=full_offload", "model.remat_group=4"], 2),
])
def test_grouped_remat_gives_the_loss_and_gradients_of_plain_remat(plain, overrides, pieces):
  loss, params, mesh = _loss_fn(overrides, pieces)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.value_and_grad(loss))(params)
  np.testing.assert_allclose(got[0], plain[0], rtol=1e-6)
  for g, e in zip(jax.tree.leaves(got[1]), jax.tree.leaves(plain[1])):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-7)


def _host_residuals(overrides, pieces=None) -> list[tuple[int, ...]]:
  """The shapes of what the backward keeps in host memory (jax's public print of the saved residuals, e.g.
  `f32<host>[2,2,256,64] output of ...`)."""
  loss, params, mesh = _loss_fn(overrides, pieces)
  out = io.StringIO()
  with jax.set_mesh(mesh), contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(loss, params)
  return [tuple(int(n) for n in m.group(1).split(",")) for m in re.finditer(r"<host>\[([\d,]+)\]", out.getvalue())]


@pytest.mark.parametrize("group, pieces", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_offload_saves_one_input_per_group_in_slices_of_the_width(group, pieces):
  # Only each group's input goes to host memory: a layer inside a group must not name its input, since the group's
  # policy would see the name and save every layer's after all (it did, before the inner layers were unnamed).
  host = _host_residuals(["model.remat=full_offload", f"model.remat_group={group}"], pieces)
  d_model = _config().model.d_model
  assert len(host) == pieces
  assert host == [(LAYERS // group, BATCH, TOKENS, d_model // pieces)] * pieces


def test_offload_slices_keep_each_copy_under_4_gib():
  # Llama 3.1 8B at 33,554,432 tokens over 64 devices: a saved input is 524,288 tokens × 4,096 × 2 bytes, exactly
  # 4 GiB, which libtpu aborts compiling as one copy; in two slices of the width each copy is 2 GiB.
  c = config.load("configs/recipes/llama3.1-8b-14m-ring-v5p-128.yml",
                  ["data.seq_len=33554432", "model.remat_group=2"])
  sizes = trainer.validate(c, 64, platform="tpu")
  assert trainer.offload_pieces(c, sizes) == 2
  assert trainer.offloaded_bytes_per_device(c, sizes) == 16 * 4 * 2**30   # 16 groups' inputs, 64 GiB
  assert trainer.offload_pieces(c.replace(**{"data.seq_len": 14680064}), sizes) == 1   # 1.75 GiB: one copy


def test_offload_no_slice_can_keep_under_4_gib_is_refused():
  # A width of 1,031 (prime) has no slices of whole 128-lane tiles: 2^24 float32 tokens per device × 1,031 is over
  # 4 GiB in one copy.
  c = _config("model.remat=full_offload", "model.d_model=1031", f"data.seq_len={2**24 * 8}")
  with pytest.raises(ConfigError, match=r"full_offload cannot copy the saved layer inputs to host memory in slices "
                                        r"of the model width under 4,096 MiB \(each a multiple of 128 wide\), which "
                                        r"libtpu needs; put more devices on mesh.ici.context"):
    trainer.validate(c, 8, platform="tpu")
  trainer.validate(c, 8, platform="cpu")   # only libtpu has the limit


@pytest.mark.parametrize("overrides, message", [
    (["model.remat=save_attention_out", "model.remat_group=2"],
     "model.remat_group 2 groups layers only under model.remat full or full_offload, not save_attention_out; set "
     "model.remat_group: 1 or one of those policies."),
    (["model.remat=full", "model.remat_group=2", "model.scan_layers=false"],
     "model.remat_group 2 needs model.scan_layers: true (the groups are slices of the scanned layers); set it, or "
     "model.remat_group: 1."),
    (["model.remat=full", "model.remat_group=3"],
     "model.remat_group 3 does not divide the model's 4 layers; choose a divisor of model.n_layers."),
    (["model.remat_group=0"], "model.remat_group is 0; it must be at least 1."),
])
def test_a_remat_group_the_run_cannot_use_is_refused_before_compiling(overrides, message):
  with pytest.raises(ConfigError) as e:
    trainer.validate(_config(*overrides), 8)
  assert str(e.value) == message
