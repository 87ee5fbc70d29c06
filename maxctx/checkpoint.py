"""Checkpoints of a run with Orbax: async saves of the train state and the data position, exact resume.

  <run.output_dir>/checkpoints/<step>/
    state/  TrainState (step, params, opt_state) as Orbax arrays; restored into this run's mesh shardings, so a run
            saved on one mesh continues on another (`python -m maxctx.convert export` reads its `params` subtree)
    data/   process_<i>-of-<n>.json: each process's data pipeline state, written by grain's Orbax handler
    meta/   the resolved config, the mesh and the process count that wrote the step

Orbax writes a step into `<step>.orbax-checkpoint-tmp-*` and renames it when every file is down, so a crash mid-save
leaves the previous step as the latest; the leftover is reported and removed. A finished step that fails to read back
(a truncated file, say) is reported, moved aside to `<step>.corrupt-<time>` and the step before it is used. A save
that cannot be written (no permission, a full disk), at once or in the background, stops the run with one sentence
naming that step and the last good one, which is kept.

checkpoint.resume:
  auto   the newest step that reads back, if the checkpoints are of this run (MUST_MATCH); none: start fresh
  never  start fresh; refused while steps exist, unless checkpoint.overwrite (they are deleted at the first save)
  <n>    step n exactly; refused while later steps exist, unless checkpoint.overwrite (deleted at the first save)

A run's randomness is run.seed (parameter init, data order) plus the data position saved in data/, so a resumed run
computes bit-for-bit the losses of the uninterrupted one. checkpoint.load_params starts a *new* run (step 0, fresh
optimizer) from saved parameters: a converted HF model or any step of another run.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from typing import Any, Callable

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh

from maxctx import stages
from maxctx.config import Config
from maxctx.errors import CheckpointError
from maxctx.params_io import check_params, check_tree, path_of as _path, read_params, why as _why
from maxctx.resume_match import MUST_MATCH, check_compatible, fingerprint, flat as _flat, plan
from maxctx.resume_match import steps_text as _steps_text
from maxctx.trainer import Trainer, TrainState

__all__ = ["MUST_MATCH", "Checkpoints", "check_params", "check_tree", "fingerprint", "read_params"]

log = logging.getLogger("maxctx")

STATE, DATA, META = "state", "data", "meta"
META_VERSION = 1


def os_error(e: BaseException) -> OSError | None:
  """The OSError behind `e` (Orbax re-raises a background save's failure wrapped), if any."""
  seen = set()
  while e is not None and id(e) not in seen:
    if isinstance(e, OSError):
      return e
    seen.add(id(e))
    e = e.__cause__ or e.__context__
  return None


# ---------------------------------------------------------------------------------------------------------------------
# The data pipeline's state through grain's Orbax handler.


class _DataState:
  """A snapshot of `pipeline.state()` shaped as grain's handler expects: get_state() → bytes, set_state(bytes).

  The snapshot is taken at the step boundary, so an async save writes the position of the state it saves.
  """

  def __init__(self, state: dict | None = None):
    self.state = state

  def get_state(self) -> bytes:
    return json.dumps(self.state).encode()

  def set_state(self, state: bytes) -> None:
    self.state = json.loads(state)

  def start_prefetch(self) -> None:
    pass


def _registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  registry.add(STATE, ocp.args.StandardSave)
  registry.add(STATE, ocp.args.StandardRestore)
  registry.add(DATA, grain.checkpoint.CheckpointSave, grain.checkpoint.CheckpointHandler)
  registry.add(DATA, grain.checkpoint.CheckpointRestore, grain.checkpoint.CheckpointHandler)
  registry.add(META, ocp.args.JsonSave)
  registry.add(META, ocp.args.JsonRestore)
  return registry


# ---------------------------------------------------------------------------------------------------------------------
# The run's checkpoints.


class Checkpoints:
  """The checkpoints of one run: decides at construction what to resume (refusing before anything compiles), then
  restores or initialises the state, saves at step boundaries and names the last good step.

  Use as a context manager: leaving it waits for the saves in flight, so a step named in a message is on disk.
  """

  def __init__(self, config: Config, mesh: Mesh):
    self._config, self._mesh = config, mesh
    c = config.checkpoint
    self.directory = _path(config.run.output_dir) / "checkpoints"
    self.enabled = c.every_steps > 0
    self.last_saved: int | None = None  # The newest step known to be completely on disk.
    self._writing: int | None = None  # A step saved in the background and not yet known to be complete.
    self._to_delete: list[int] = []
    self._meta_cache: dict[int, dict] = {}
    self._ends = stages.ends(config)
    self._report_incomplete()
    # create=False: a run that is refused must leave no directory behind; the first save creates it.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=c.keep, enable_async_checkpointing=c.async_save, create=False,
        cleanup_tmp_directories=True, save_interval_steps=1)
    self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=_registry())
    try:
      self._candidates, self._to_delete = plan(self._config, sorted(self._manager.all_steps()), self.directory)
      self._check_run(self._candidates)
    except BaseException:
      self._manager.close()  # Its threads would outlive the refusal otherwise.
      raise

  def __enter__(self) -> Checkpoints:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    try:
      self._manager.close()
    except Exception as e:  # noqa: BLE001 — a background save that failed; reported unless already reported.
      if os_error(e) is None:
        raise
      if self._writing is not None:
        step, self._writing = self._writing, None
        raise self._failed(step, e) from None

  def step_path(self, step: int) -> epath.Path:
    return self.directory / str(step)

  # -- What to resume, decided from the files alone. --

  def _report_incomplete(self) -> None:
    if not self.directory.exists():
      return
    for p in sorted(self.directory.iterdir()):
      if ".orbax-checkpoint-tmp" in p.name:
        log.warning("checkpoint: %s is a save that never finished (the run stopped while writing step %s); it is "
                    "ignored and removed.", p, p.name.split(".", 1)[0])

  def _read_meta(self, step: int) -> dict:
    if step not in self._meta_cache:
      meta = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
      if not isinstance(meta, dict) or "config" not in meta:
        raise ValueError(f"{META} item holds no config")
      self._meta_cache[step] = meta
    return self._meta_cache[step]

  def _check_run(self, steps: list[int]) -> None:
    """Refuses checkpoints of another run, judged by the newest step whose metadata reads."""
    for step in steps:
      try:
        meta = self._read_meta(step)
      except Exception:  # Reported, with its reason, when restoring walks past it.
        continue
      self._check_compatible(step, meta)
      return

  def _check_compatible(self, step: int, meta: dict) -> None:
    check_compatible(self._config, meta, step, self.directory, self.step_path(step))

  # -- Restore or initialise. --

  def restore_or_init(self, trainer_at: Callable[[int], Trainer],
                      restore_data: Callable[[int, dict], None]) -> TrainState:
    """The newest readable checkpoint, else load_params, else init. `trainer_at(step)`: the trainer that continues a
    state after `step` steps (its stage's, with run.stages), into whose shardings the state is restored;
    `restore_data(step, saved)` restores the data position saved with that step."""
    for i, step in enumerate(self._candidates):
      try:
        meta = self._read_meta(step)
        saved_tree = self._manager.item_metadata(step)[STATE]
      except Exception as e:  # noqa: BLE001 — any failure to read a finished step is corruption to report.
        self._corrupt(step, e, self._candidates[i + 1:])
        continue
      self._check_compatible(step, meta)
      trainer = trainer_at(step)
      abstract = trainer.abstract_state()
      check_tree(saved_tree, abstract, f"checkpoint step {step} in {self.directory}",
                 "the model.* keys differ from those of the run that saved it (see its config.yml); use a new "
                 "run.output_dir for a different model.")
      t = time.perf_counter()
      try:
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            STATE: ocp.args.StandardRestore(abstract), DATA: grain.checkpoint.CheckpointRestore(_DataState())}))
      except Exception as e:  # noqa: BLE001
        self._corrupt(step, e, self._candidates[i + 1:])
        continue
      restore_data(step, restored[DATA].state)
      self._log_changes(step, meta)
      log.info("checkpoint: restored step %d from %s in %.1fs (saved on mesh %s, restored onto %s)", step,
               self.step_path(step), time.perf_counter() - t, meta.get("mesh"), dict(trainer.mesh.shape))
      if self._config.checkpoint.load_params:
        log.info("checkpoint: checkpoint.load_params is not used: the run resumes its own step %d.", step)
      self.last_saved = step
      return restored[STATE]
    if self._candidates:
      raise CheckpointError(f"no checkpoint in {self.directory} reads back (see the warnings above); move the "
                            "directory away, or set checkpoint.resume=never with checkpoint.overwrite=true to start "
                            "afresh.")
    trainer = trainer_at(0)
    if self._config.checkpoint.load_params:
      return self._load_params(trainer, trainer.abstract_state())
    return trainer.init(jax.random.key(self._config.run.seed))

  def _corrupt(self, step: int, e: BaseException, rest: list[int]) -> None:
    if self._config.checkpoint.resume not in ("auto", "never"):
      raise CheckpointError(f"checkpoint step {step} in {self.directory} cannot be read ({_why(e)}); choose another "
                            "step with checkpoint.resume or use checkpoint.resume=auto.")
    aside = self.directory / f"{step}.corrupt-{int(time.time())}"
    if jax.process_index() == 0:
      self.step_path(step).rename(aside)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"maxctx checkpoint aside {step}")
    self._manager.reload()
    then = f"using step {rest[0]}" if rest else "no earlier step is left"
    log.warning("checkpoint: step %d in %s cannot be read (%s); moved it to %s, %s.", step, self.directory, _why(e),
                aside, then)

  def _log_changes(self, step: int, meta: dict) -> None:
    before, after = _flat(meta["config"]), _flat(self._config.to_dict())
    changed = [f"{k} {before.get(k)!r} → {v!r}" for k, v in after.items()
               if k in before and before[k] != v and not k.startswith("checkpoint.")]  # New schema keys are no change.
    if changed:
      log.info("checkpoint: resuming step %d with changed settings: %s", step, "; ".join(changed))

  def _load_params(self, trainer: Trainer, abstract: TrainState) -> TrainState:
    params = read_params(self._config.checkpoint.load_params, abstract.params)
    log.info("checkpoint: training starts at step 0 from these parameters with a fresh optimizer")
    return _state_from_params(trainer, params)

  # -- Saving. --

  def due(self, step: int) -> bool:
    """Whether step `step` (the number of steps done) is a regular save: every checkpoint.every_steps, the end of
    each stage (maxctx.stages) and the last."""
    c = self._config.checkpoint
    return self.enabled and (step % c.every_steps == 0 or step == self._config.run.steps or step in self._ends)

  def on_mesh(self, mesh: Mesh) -> None:
    """The mesh the next saves' metadata names (a stage's, with run.stages)."""
    self._mesh = mesh

  def save(self, step: int, state: TrainState, data_state: dict, wait: bool = False) -> bool:
    """Saves `state` (after `step` steps) and the data position; async unless `wait`. False when saving is off.

    A save that cannot be written (no permission, disk full), now or in the background, stops the run with a
    CheckpointError naming the step and the last good checkpoint, which is kept."""
    if not self.enabled or step in (self.last_saved, self._writing):
      return False
    self.wait()  # The previous save's failure, if any, is reported as that step's.
    if self._to_delete:
      log.warning("checkpoint: deleting steps %s in %s (checkpoint.overwrite=true)", _steps_text(self._to_delete),
                  self.directory)
      for s in self._to_delete:
        self._manager.delete(s)
      self._to_delete = []
    t = time.perf_counter()
    meta = {"version": META_VERSION, "step": step, "config": self._config.to_dict(), "mesh": dict(self._mesh.shape),
            "processes": jax.process_count(), "time": time.time()}
    self._writing = step
    try:
      if jax.process_index() == 0:
        self._probe(step)
      self._manager.save(step, force=True, args=ocp.args.Composite(**{
          STATE: ocp.args.StandardSave(state), DATA: grain.checkpoint.CheckpointSave(_DataState(data_state)),
          META: ocp.args.JsonSave(meta)}))
    except Exception as e:  # noqa: BLE001
      if os_error(e) is None:
        raise
      self._writing = None
      raise self._failed(step, e) from None
    blocked = time.perf_counter() - t
    if wait or not self._config.checkpoint.async_save:
      self.wait()
    mode = "in the background" if self._config.checkpoint.async_save and not wait else "done"
    log.info("checkpoint: saving step %d to %s (%s; the loop waited %.2fs)", step, self.step_path(step), mode,
             time.perf_counter() - t if wait else blocked)
    return True

  def _probe(self, step: int) -> None:
    """Creates (and removes) a directory where Orbax is about to: a directory that became unwritable fails here, at
    once, instead of in Orbax's background thread, which leaves the save waiting minutes for a signal."""
    self.directory.mkdir(parents=True, exist_ok=True)
    probe = self.directory / f"{step}.maxctx-write-probe"
    probe.mkdir(exist_ok=True)
    probe.rmdir()

  def wait(self) -> None:
    """Waits for the save in flight; raises the CheckpointError of one that failed."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      if os_error(e) is None or self._writing is None:
        raise
      step, self._writing = self._writing, None
      raise self._failed(step, e) from None
    if self._writing is not None:
      self.last_saved, self._writing = self._writing, None

  def _failed(self, step: int, e: BaseException) -> CheckpointError:
    err = os_error(e)
    cause = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
             errno.EACCES: "permission denied", errno.EPERM: "permission denied",
             errno.EROFS: "the filesystem is read-only"}.get(getattr(err, "errno", None), _why(err or e))
    fix = "free space" if "disk" in cause else "make it writable"
    if self.last_saved is None:
      return CheckpointError(f"saving checkpoint step {step} to {self.directory} failed ({cause}); the run stopped "
                             f"before any checkpoint was saved; {fix} and rerun the command.")
    return CheckpointError(f"saving checkpoint step {step} to {self.directory} failed ({cause}); the run stopped and "
                           f"{self.last_good()}, which is kept; {fix} and rerun the command to continue from it.")

  def last_good(self) -> str:
    """The last good checkpoint, in words, for messages that stop the run."""
    if self.last_saved is None:
      why = " (checkpoint.every_steps=0)" if not self.enabled else ""
      return f"no checkpoint was saved{why}"
    return f"the last good checkpoint is step {self.last_saved} in {self.step_path(self.last_saved)}"


def _state_from_params(trainer: Trainer, params: Any) -> TrainState:
  """Step 0 with these parameters and a fresh optimizer state, in the trainer's shardings."""
  def make(p):
    return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=trainer.tx.init(p))
  return jax.jit(make, out_shardings=trainer.state_shardings, donate_argnums=0)(params)
