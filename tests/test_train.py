"""The trainer end to end: the demo learns and logs to TensorBoard, accumulation is exact, state is ZeRO-3 sharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maxctx import config, data, mesh as mesh_lib, reporter, train
from maxctx.errors import ConfigError
from maxctx.trainer import Trainer


def _tensorboard_losses(logdir):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(str(logdir))
  acc.Reload()
  return [(e.step, e.value) for e in acc.Scalars("loss")]


def _demo(tmp_path, *overrides):
  """The demo on synthetic data (learnable in a few steps, no corpus to index)."""
  return config.load("configs/demo.yml", [f"run.output_dir={tmp_path}", "data.source=synthetic", *overrides])


@pytest.mark.parametrize("overrides", [
    pytest.param([], marks=pytest.mark.slow, id="the-demo-as-shipped"),
    pytest.param(["data.source=synthetic", "run.steps=30", "metrics.log_every=1"], id="synthetic-30-steps"),
])
def test_demo_loss_falls_in_tensorboard(tmp_path, overrides):
  c = config.load("configs/demo.yml", [f"run.output_dir={tmp_path}", *overrides])
  losses = train.run(c)
  logged = _tensorboard_losses(tmp_path / "tensorboard")
  assert [s for s, _ in logged][-1] == c.run.steps
  first, last = logged[0][1], logged[-1][1]
  assert last <= 0.8 * first, f"loss {first:.3f} -> {last:.3f}"
  assert last == pytest.approx(losses[-1])
  assert {"loss", "learning_rate", "grad_norm", "tokens_per_sec", "step_time", "tflops_per_device", "mfu"} <= set(
      _scalar_tags(tmp_path / "tensorboard"))
  assert (tmp_path / "config.yml").exists()


def _scalar_tags(logdir):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(str(logdir))
  acc.Reload()
  return acc.Tags()["scalars"]


def _loss_and_grads(c):
  mesh = mesh_lib.build_mesh(c.mesh)
  with jax.set_mesh(mesh):
    trainer = Trainer(c, mesh)
    state = trainer.init(jax.random.key(0))
    batch = next(data.build(c, mesh))
    n_tokens = jnp.sum(batch["segment_ids"] != 0).astype(jnp.float32)
    return jax.device_get(jax.jit(trainer._grads)(state.params, batch, n_tokens))


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
  # Compared on gradients: Adam's first update is ~lr·sign(g), which amplifies summation-order noise where g ≈ 0.
  base = ["attention.kernel=reference"]
  loss1, g1 = _loss_and_grads(_demo(tmp_path, *base, "optim.grad_accum=1"))
  loss2, g2 = _loss_and_grads(_demo(tmp_path, *base, "optim.grad_accum=2"))
  np.testing.assert_allclose(loss1, loss2, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(a).max())


def test_parameters_and_optimizer_state_are_sharded_over_fsdp_and_context(tmp_path):
  c = _demo(tmp_path, "mesh.ici.fsdp=2", "mesh.ici.context=4")
  mesh = mesh_lib.build_mesh(c.mesh)
  with jax.set_mesh(mesh):
    s = Trainer(c, mesh).state_shardings
  zero3 = ("fsdp", "context")
  assert s.params["layers"]["attn"]["wq"].spec == P(None, zero3, None, None)
  assert s.params["layers"]["mlp"]["w_down"].spec == P(None, None, zero3)
  adam = s.opt_state[1][0]  # chain(clip, adamw): adamw's ScaleByAdamState
  assert adam.mu["layers"]["attn"]["wq"].spec == P(None, zero3, None, None)
  assert adam.nu["lm_head"].spec == s.params["lm_head"].spec == P(zero3, None)


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_non_finite_loss_is_skipped_or_stops(tmp_path, policy):
  c = _demo(tmp_path, f"run.on_nan={policy}", "run.steps=2", "attention.kernel=reference")
  mesh = mesh_lib.build_mesh(c.mesh)
  with jax.set_mesh(mesh):
    trainer = Trainer(c, mesh)
    state = trainer.init(jax.random.key(0))
    poisoned = state.replace(params={**state.params, "embedding": state.params["embedding"] * jnp.nan})
    before = jax.device_get(poisoned.params["lm_head"])
    new, m = trainer.step(poisoned, next(data.build(c, mesh)))
    assert not bool(m["finite"])
    after = jax.device_get(new.params["lm_head"])
  if policy == "skip":
    np.testing.assert_array_equal(after, before)
    assert int(new.step) == 1
    # The skipped step applied no update, so the learning rate logged next is still the one of update 0.
    with jax.set_mesh(mesh):
      _, m2 = trainer.step(new, next(data.build(c, mesh)))
    assert float(m2["learning_rate"]) == float(trainer.lr_schedule(0)) != float(trainer.lr_schedule(1))


def test_eval_during_training_logs_scalars(tmp_path):
  c = config.load("configs/demo.yml", [
      f"run.output_dir={tmp_path}", "run.steps=2", "checkpoint.every_steps=0", "eval.every_steps=2",
      "eval.lengths=128", "eval.depths=0,1", "eval.samples=1", "eval.tasks=passkey"])
  train.run(c)
  assert "eval/passkey/128" in _scalar_tags(tmp_path / "tensorboard")


def test_eval_and_save_time_is_not_counted_as_step_time(tmp_path, monkeypatch):
  # A clock that jumps 1000 s during each eval and each save: no step's time (hence tokens/s and MFU) may include it.
  jump = [0.0]
  real_clock = reporter.time.perf_counter
  monkeypatch.setattr(reporter.time, "perf_counter", lambda: real_clock() + jump[0])
  during_training = train.eval_sweep.during_training

  def slow_eval(config, mesh):
    evaluator = during_training(config, mesh)
    run = evaluator.run

    def run_and_jump(params):
      records = run(params)
      jump[0] += 1000.0
      return records
    evaluator.run = run_and_jump
    return evaluator

  monkeypatch.setattr(train.eval_sweep, "during_training", slow_eval)
  save = train.checkpoint_lib.Checkpoints.save

  def slow_save(self, *args, **kwargs):
    save(self, *args, **kwargs)
    jump[0] += 1000.0
  monkeypatch.setattr(train.checkpoint_lib.Checkpoints, "save", slow_save)
  c = config.load("configs/demo.yml", [
      f"run.output_dir={tmp_path}", "run.steps=6", "checkpoint.every_steps=3", "eval.every_steps=2",
      "eval.lengths=128", "eval.depths=0", "eval.samples=1", "eval.tasks=passkey", "metrics.log_every=1"])
  train.run(c)
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(str(tmp_path / "tensorboard"))
  acc.Reload()
  times = [e.value for e in acc.Scalars("step_time")]
  assert jump[0] == 5000.0 and len(times) == 6 and max(times) < 1000.0, times   # evals at 2, 4, 6; saves at 3, 6


def test_offload_larger_than_host_memory_stops_before_compiling(tmp_path, monkeypatch):
  # remat full_offload parks every layer's saved input in host RAM; a host too small is a config error up front.
  monkeypatch.setattr(train, "host_memory_bytes", lambda: 2**20)
  monkeypatch.setattr(Trainer, "__post_init__", lambda self: pytest.fail("compiled before checking host memory"))
  c = _demo(tmp_path, "model.remat=full_offload")
  with pytest.raises(ConfigError, match=r"full_offload would keep 8 MiB of saved layer inputs in this host's memory, "
                                        r"more than 80% of its 1 MiB; save one input per pair of layers "
                                        r"\(model.remat_group=2\), or use model.remat=full"):
    train.run(c)
  assert not (tmp_path / "config.yml").exists()
  # In pairs of layers (model.remat_group 2) half of it is kept: the 4 MiB are counted, and still refused here.
  with pytest.raises(ConfigError, match=r"full_offload would keep 4 MiB of saved layer inputs"):
    train.run(_demo(tmp_path, "model.remat=full_offload", "model.remat_group=2"))
