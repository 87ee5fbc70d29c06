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


def test_offload_no_slice_of_whole_tiles_can_keep_under_4_gib_is_refused():
  # A width of 1,032 (8 × 129: its parameters split over the 8 devices, but no 128-lane tile divides it) has no
  # slices of whole tiles: 2 rows × 1,048,576 float32 tokens per device × 1,032 is 8 GiB in one copy (in 1,032
  # one-column slices it would be 8 MiB each, which the tile rule refuses). A width of 1,024 goes in 4 slices of 256.
  seq_len = f"data.seq_len={2**20 * 8}"
  c = _config("model.remat=full_offload", "model.d_model=1032", seq_len)
  with pytest.raises(ConfigError, match=r"full_offload would copy saved layer inputs of 8,256 MiB per device to host "
                                        r"memory, and no slicing of the model width into multiples of 128 brings a "
                                        r"copy under 4,096 MiB, which libtpu needs; put more devices on"):
    trainer.validate(c, 8, platform="tpu")
  trainer.validate(c, 8, platform="cpu")   # only libtpu has the limit
  wide = _config("model.remat=full_offload", "model.d_model=1024", seq_len)
  assert trainer.offload_pieces(wide, trainer.validate(wide, 8, platform="tpu")) == 4


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


# The planner and the reports, with layer groups.

V5P_14M = "configs/recipes/llama3.1-8b-14m-ring-v5p-128.yml"


def test_the_planner_does_not_compile_what_would_overfill_a_host_vm_and_says_what_would_fit(tmp_path):
  # 8B at 33,554,432 tokens on v5p-128 with every layer's input offloaded: 512 GiB per 4-chip VM of 448 GB. The
  # model's host bytes are exactly the compiler's, so nothing is compiled to learn it.
  from maxctx.plan import candidates as plan_candidates, estimated, ranking, tables
  base = config.load(V5P_14M)
  cands = plan_candidates.candidates(base, ["ring"], 2**25, ["full_offload"], 64, platform="tpu", chunks=[16384],
                                     groups=[1])
  records = estimated.estimate_all(cands, 64, 1, tmp_path, [], True, 1)
  assert [r.reason for r in records] == ["not compiled: expected to keep 512.0 GiB of saved layer inputs in each host "
                                         "VM's memory, over 80% of its 448 GB"]
  assert not list(tmp_path.rglob("*.json"))   # no compile was cached
  assert tables.verdict(ranking.rank(cands, records)) == (
      "Nothing fits: ring c=64 remat=full_offload mlp_chunk=16384 would fit HBM (69.9 GiB per device), but was "
      "expected to keep 512.0 GiB of saved layer inputs in each host VM's memory, over 80% of its 448 GB; try one "
      "saved input per pair of layers (--remat-group 2), more devices or a shorter length.")


def test_topology_plans_try_pairs_of_layers_under_the_policies_that_save_only_inputs():
  from maxctx.plan import candidates as plan_candidates
  from maxctx.errors import ConfigError
  base = config.load(V5P_14M)
  assert plan_candidates.remat_group_flag(None, base, topology=False) == [1]
  assert plan_candidates.remat_group_flag(None, base, topology=True) == [1, 2]
  paired = base.replace(**{"model.remat_group": 2})
  assert plan_candidates.remat_group_flag(None, paired, topology=True) == [2, 1]   # ungrouped is tried too
  assert plan_candidates.remat_group_flag("1,4", base, topology=True) == [1, 4]
  with pytest.raises(ConfigError, match=r"--remat-group is '0'; give comma-separated layer counts of at least 1"):
    plan_candidates.remat_group_flag("0", base, topology=True)
  assert plan_candidates.remats_with_groups(["full", "save_attention_out", "full_offload"], [1, 3]) == [
      ("full", 1), ("full", 3), ("save_attention_out", 1), ("full_offload", 1), ("full_offload", 3)]
  # A group that does not divide the layers is a candidate refused with validate's sentence, not silently dropped.
  cands = plan_candidates.candidates(base, ["ring"], 2**24, ["full"], 64, platform="tpu", groups=[3])
  assert [c.case.refused for c in cands if c.context == 64] == [
      "model.remat_group 3 does not divide the model's 32 layers; choose a divisor of model.n_layers."]


def _report_tree(c) -> dict:
  """A maxctx.compile --json report of `c` on v5p-128 (the fields a report is matched and estimated by)."""
  import dataclasses
  from maxctx import topology
  from maxctx.compile import step as compile_step
  from maxctx.compile.report import CompileReport
  from maxctx.bench import aot
  tree = {f.name: 0 for f in dataclasses.fields(CompileReport)
          if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
  mesh = {"data": 1, "fsdp": 1, "context": 64, "tensor": 1}
  tree.update(aot._expected(c, topology.resolve("v5p-128"), 1, mesh), step=compile_step.step_key(c), fits=True,
              flops_per_step=64e18, flops_per_device=1e18, devices=64)
  return tree


def test_reports_are_reused_only_for_their_own_layer_group_and_old_ones_read_as_ungrouped(tmp_path):
  import json
  from maxctx import topology
  from maxctx.compile import step as compile_step
  from maxctx.compile.report import CompileReport
  from maxctx.bench import aot, roofline
  plain = config.load(V5P_14M)
  paired = plain.replace(**{"model.remat_group": 2})
  (tmp_path / "paired.json").write_text(json.dumps(_report_tree(paired)))
  topo, mesh = topology.resolve("v5p-128"), {"data": 1, "fsdp": 1, "context": 64, "tensor": 1}
  assert aot.find_report(tmp_path, paired, topo, 1, mesh) is not None
  assert aot.find_report(tmp_path, plain, topo, 1, mesh) is None   # its host memory would be twice the report's
  old = _report_tree(plain)
  del old["step"]["model"]["remat_group"]   # written before model.remat_group existed
  (tmp_path / "old.json").write_text(json.dumps(old))
  report, path = aot.find_report(tmp_path, plain, topo, 1, mesh)
  assert path.name == "old.json" and report.step["model"]["remat_group"] == 1
  assert compile_step.step_key(plain) == report.step   # so the launcher's fit check takes it for this recipe
  # The roofline counts the forward three times in groups: 5/3 of the step's FLOPs, against 4/3.
  grouped = CompileReport.from_json(_report_tree(paired))
  ratio = roofline.estimate(grouped, topo)["est_compute_s"] / roofline.estimate(report, topo)["est_compute_s"]
  assert ratio == pytest.approx(5 / 4)
