"""Checkpoints are never trusted blindly: a corrupt or unfinished latest step falls back to the one before, another
run's checkpoints are refused untouched, a state that does not fit the model names the parameter, and a non-finite
loss names the last good checkpoint.

Acceptance (issue 5): 4 corruption, and the guards around it. Most checks build the Checkpoints and restore without
compiling the train step; one resumes end to end.
"""

from __future__ import annotations

import logging
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxctx import checkpoint, config, data, mesh as mesh_lib, train
from maxctx.errors import CheckpointError, ConfigError, MaxctxError
from maxctx.trainer import Trainer

BASE = ["data.source=synthetic", "data.seq_len=64", "metrics.tensorboard=false", "metrics.log_every=100",
        "checkpoint.every_steps=2"]


def _config(out_dir, *overrides):
  return config.load("configs/demo.yml", [f"run.output_dir={out_dir}", *BASE, *overrides])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A 6-step run saving every 2 steps (steps 2, 4, 6 kept), and its losses."""
  out = tmp_path_factory.mktemp("trained")
  losses = train.run(_config(out, "run.steps=6"))
  assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "4", "6"]
  return out, losses


@pytest.fixture
def run_dir(tmp_path, trained):
  out = tmp_path / "run"
  shutil.copytree(trained[0], out)
  return out


def _restore(out_dir, *overrides):
  """(restored state on the host, the Checkpoints) for the demo config with `overrides`; no train step compiles."""
  c = _config(out_dir, *overrides)
  mesh = mesh_lib.build_mesh(c.mesh)
  with jax.set_mesh(mesh), checkpoint.Checkpoints(c, mesh) as ckpt:
    trainer, pipeline = Trainer(c, mesh), data.build(c, mesh)
    state = ckpt.restore_or_init(lambda step: trainer, lambda step, saved: pipeline.restore(saved))
    return jax.device_get(state), ckpt


def _files(root: pathlib.Path) -> dict[str, int]:
  return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def _largest(directory: pathlib.Path) -> pathlib.Path:
  return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


# ---------------------------------------------------------------------------------------------------------------------
# Corrupt and unfinished steps.


@pytest.mark.parametrize("victim", ["array data", "state/_METADATA", "data/process_0-of-1.json", "meta/metadata"])
def test_truncated_latest_step_is_reported_and_the_previous_one_used(run_dir, caplog, victim):
  step6 = run_dir / "checkpoints" / "6"
  path = _largest(step6 / "state") if victim == "array data" else step6 / victim
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
  with caplog.at_level(logging.WARNING, logger="maxctx"):
    state, _ = _restore(run_dir, "run.steps=8")
  assert int(state.step) == 4
  warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
  assert "step 6" in warning and "cannot be read" in warning and "using step 4" in warning, warning
  assert not step6.exists() and list((run_dir / "checkpoints").glob("6.corrupt-*"))


def test_resume_past_a_corrupt_step_gives_the_uninterrupted_losses(run_dir, trained, caplog):
  path = _largest(run_dir / "checkpoints" / "6" / "state")
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
  with caplog.at_level(logging.WARNING, logger="maxctx"):
    losses = train.run(_config(run_dir, "run.steps=6"))
  assert "step 6" in caplog.text and "using step 4" in caplog.text
  assert losses == trained[1][4:]  # Steps 5 and 6 again, bit for bit.
  assert (run_dir / "checkpoints" / "6" / "state").is_dir()  # Saved afresh.


def test_unfinished_save_is_reported_ignored_and_removed(run_dir, caplog):
  tmp = run_dir / "checkpoints" / "8.orbax-checkpoint-tmp-1234567"
  (tmp / "state").mkdir(parents=True)
  (tmp / "state" / "half_written").write_bytes(b"\0" * 10)
  with caplog.at_level(logging.WARNING, logger="maxctx"):
    state, _ = _restore(run_dir, "run.steps=8")
  assert int(state.step) == 6
  assert "never finished" in caplog.text and "step 8" in caplog.text
  assert not tmp.exists()


def test_every_step_unreadable_stops_with_a_sentence(run_dir):
  for step in (2, 4, 6):
    path = run_dir / "checkpoints" / str(step) / "meta" / "metadata"
    path.write_bytes(b"{")
  with pytest.raises(CheckpointError, match="no checkpoint in .* reads back"):
    _restore(run_dir, "run.steps=8")


def test_a_named_corrupt_step_is_not_replaced_by_another(run_dir):
  path = _largest(run_dir / "checkpoints" / "4" / "state")
  path.write_bytes(path.read_bytes()[:10])
  with pytest.raises(CheckpointError, match="checkpoint step 4 .* cannot be read"):
    _restore(run_dir, "checkpoint.resume=4", "checkpoint.overwrite=true")


# ---------------------------------------------------------------------------------------------------------------------
# Another run's checkpoints are refused untouched; starting afresh over them needs checkpoint.overwrite.


@pytest.mark.parametrize("override, fragment", [
    ("model.d_ff=256", "model.d_ff was 384, this run has 256"),
    ("model.scan_layers=false", "model.scan_layers was True"),
    ("run.seed=7", "checkpoint.load_params="),
    ("data.batch_size=16", "data.batch_size was 8"),
    ("optim.clip_norm=0", "optim.clip_norm > 0"),
])
def test_checkpoints_of_another_run_are_refused_untouched(run_dir, override, fragment):
  before = _files(run_dir)
  with pytest.raises(CheckpointError, match="holds checkpoints of another run") as e:
    train.run(_config(run_dir, override))
  assert fragment in str(e.value) and "new run.output_dir" in str(e.value)
  assert _files(run_dir) == before  # Not even config.yml was rewritten.


def test_resume_never_refuses_existing_checkpoints_unless_overwrite(run_dir):
  with pytest.raises(CheckpointError, match="resume=never would overwrite them.*checkpoint.overwrite=true"):
    checkpoint.Checkpoints(_config(run_dir, "checkpoint.resume=never"), mesh_lib.build_mesh(_config(run_dir).mesh))
  losses = train.run(_config(run_dir, "checkpoint.resume=never", "checkpoint.overwrite=true", "run.steps=2"))
  assert len(losses) == 2  # Started at step 0 ...
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2"]  # ... and the old steps are gone.


def test_resume_at_a_step(run_dir):
  mesh = mesh_lib.build_mesh(_config(run_dir).mesh)
  with pytest.raises(CheckpointError, match="resume=3 but .* holds checkpoints of steps 2, 4, 6"):
    checkpoint.Checkpoints(_config(run_dir, "checkpoint.resume=3"), mesh)
  with pytest.raises(CheckpointError, match="later steps 6, which this run would overwrite"):
    checkpoint.Checkpoints(_config(run_dir, "checkpoint.resume=4"), mesh)
  state, _ = _restore(run_dir, "checkpoint.resume=4", "checkpoint.overwrite=true")
  assert int(state.step) == 4


@pytest.mark.parametrize("override, fragment", [
    ("checkpoint.resume=latest", "checkpoint.resume is 'latest'"),
    ("checkpoint.keep=0", "checkpoint.keep is 0"),
    ("checkpoint.every_steps=-1", "checkpoint.every_steps is -1"),
])
def test_bad_checkpoint_keys_are_config_errors(tmp_path, override, fragment):
  with pytest.raises(ConfigError, match=fragment):
    config.check(_config(tmp_path, override))


# ---------------------------------------------------------------------------------------------------------------------
# States that do not fit the model, and parameters loaded from a checkpoint.


def test_tree_mismatch_names_the_parameter():
  want = {"params": {"layers": {"wq": jax.ShapeDtypeStruct((2, 8), jnp.float32)}, "head": np.zeros(3)}}
  with pytest.raises(CheckpointError, match=r"holds parameter layers.wq with shape \(2, 4\), but the model needs "
                                            r"\(2, 8\); fix"):
    checkpoint.check_tree({"params": {"layers": {"wq": np.zeros((2, 4))}, "head": np.zeros(3)}}, want, "here", "fix")
  with pytest.raises(CheckpointError, match=r"here has no parameter head \(shape \(3,\)\), which the model has"):
    checkpoint.check_tree({"params": {"layers": {"wq": np.zeros((2, 8))}}}, want, "here", "fix")
  with pytest.raises(CheckpointError, match="holds optimizer state opt_state.mu.x .* which the model does not have"):
    checkpoint.check_tree({**want, "opt_state": {"mu": {"x": np.zeros(1)}}}, want, "here", "fix")


def test_load_params_from_a_training_checkpoint_starts_a_new_run(tmp_path, run_dir):
  step4, _ = _restore(run_dir, "checkpoint.resume=4", "checkpoint.overwrite=true")
  state, _ = _restore(tmp_path / "new", f"checkpoint.load_params={run_dir}/checkpoints/4")
  assert int(state.step) == 0
  for a, b in zip(jax.tree.leaves(step4.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, b)
  assert all(not np.any(x) for x in jax.tree.leaves(state.opt_state))  # A fresh optimizer.


def test_load_params_that_do_not_fit_name_the_parameter(tmp_path, run_dir):
  with pytest.raises(CheckpointError, match=r"checkpoint.load_params .* holds parameter layers.mlp.w_\w+ with shape "
                                            r".* but the model needs .*model.yml"):
    _restore(tmp_path / "new", f"checkpoint.load_params={run_dir}/checkpoints/4", "model.d_ff=256")
  with pytest.raises(CheckpointError, match="is not a directory"):
    _restore(tmp_path / "new", f"checkpoint.load_params={tmp_path}/nowhere")


# ---------------------------------------------------------------------------------------------------------------------
# A non-finite loss.


def test_non_finite_loss_stops_naming_the_step_and_the_last_good_checkpoint(tmp_path):
  # A learning rate of 1e30 makes the first update overflow the parameters, so step 2's loss is not finite.
  c = _config(tmp_path, "run.steps=4", "checkpoint.every_steps=1", "optim.lr=1e30", "optim.warmup_steps=0",
              "optim.clip_norm=0")
  with pytest.raises(MaxctxError) as e:
    train.run(c)
  message = str(e.value)
  assert message.startswith("step 2: loss is nan") or message.startswith("step 2: loss is inf"), message
  assert f"the last good checkpoint is step 1 in {tmp_path}/checkpoints/1" in message
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]
