"""What a run resumes: the policy of `checkpoint.resume` over the steps on disk, and what a checkpoint must share
with the run that resumes it. Decided from the files' names and metadata alone; maxctx.checkpoint does the reading.

A resumed run computes bit-for-bit the losses of the uninterrupted one only if the keys in MUST_MATCH are the same;
everything else (mesh, strategy, run.steps, learning rate, ...) may change between restarts, and the changes are
logged (maxctx.checkpoint).
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from maxctx import stages
from maxctx.config import Config, from_saved

from maxctx.data import STREAM_KEYS
from maxctx.errors import CheckpointError, excerpt

log = logging.getLogger("maxctx")

# They fix the parameter shapes, what the model computes and which batch comes next.
MUST_MATCH = (
    "model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.head_dim",
    "model.d_ff", "model.norm_eps", "model.rope_theta", "model.rope_scaling", "model.rope_factor",
    "model.rope_low_freq_factor", "model.rope_high_freq_factor", "model.rope_original_context", "model.param_dtype",
    "model.scan_layers", "attention.load_balance", *STREAM_KEYS,
)
# Keys added since checkpoints were first saved, with the value that does what a checkpoint saved before them did.
ADDED = {"data.mixture": [], "data.long_threshold": 0, "data.long_weight": 1.0}
# Not a key but a fact about one: clipping adds a stage to the optimizer state's structure.
CLIPS = "optim.clip_norm > 0"


def _boundaries(config: Config | None, step: int) -> list[int]:
  """The stage ends before `step`: what decides which stage made each step before it (the stage that made `step`
  itself is compared by its keys, so it may be lengthened, or split at `step`, and stages appended)."""
  if config is None or not config.run.stages:
    return []
  return [s.end for s in stages.resolve(config) if s.end < step]


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
  for part in dotted.split("."):
    if not isinstance(tree, dict) or part not in tree:
      return None
    tree = tree[part]
  return tree


def fingerprint(tree: dict[str, Any]) -> dict[str, Any]:
  """What must match to resume, from a config's dict (this run's or a saved one)."""
  out = {k: _lookup(tree, k) for k in MUST_MATCH}
  out.update({k: v for k, v in ADDED.items() if out[k] is None})
  clip = _lookup(tree, "optim.clip_norm")
  out[CLIPS] = clip is not None and clip > 0
  return out


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  """A nested config dict as {"section.key": value}."""
  out = {}
  for k, v in tree.items():
    out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
  return out


def steps_text(steps) -> str:
  steps = sorted(steps)
  return ", ".join(map(str, steps)) if len(steps) <= 4 else f"{steps[0]}, {steps[1]}, …, {steps[-1]}"


def plan(config: Config, steps: list[int], where: Any) -> tuple[list[int], list[int]]:
  """(the steps to try restoring, newest first; the steps to delete at the first save) for the steps in `where`;
  raises if they are checkpoints this run must not touch."""
  c = config.checkpoint
  saves = c.every_steps > 0
  if not steps:
    if c.resume not in ("auto", "never"):
      raise CheckpointError(f"checkpoint.resume={c.resume} but {where} holds no checkpoints; set "
                            "checkpoint.resume=auto or never, or point run.output_dir at the run that saved it.")
    return [], []
  held = f"{where} holds checkpoints of steps {steps_text(steps)}"
  if c.resume == "never":
    if saves and not c.overwrite:
      raise CheckpointError(f"{held} and checkpoint.resume=never would overwrite them; use a new run.output_dir, "
                            "move them away, or set checkpoint.overwrite=true to delete them.")
    if not saves:
      return [], []
    log.warning("checkpoint: %s; checkpoint.resume=never with checkpoint.overwrite=true deletes them at the first "
                "save.", held)
    return [], list(steps)
  if c.resume == "auto":
    return steps[::-1], []
  step = int(c.resume)
  if step not in steps:
    raise CheckpointError(f"checkpoint.resume={step} but {held}; choose one of them or checkpoint.resume=auto.")
  later = [s for s in steps if s > step]
  if later and saves and not c.overwrite:
    raise CheckpointError(f"checkpoint.resume={step} but {where} also holds later steps {steps_text(later)}, which "
                          "this run would overwrite; use checkpoint.resume=auto, or set checkpoint.overwrite=true to "
                          "delete them.")
  return [step], later if saves else []


def check_compatible(config: Config, meta: dict, step: int, where: Any, step_path: Any) -> None:
  """Refuses step `step` (in `where`, at `step_path`) of another run, judged by its saved metadata: with run.stages,
  by the config of the stage that made the step, and the stage boundaries up to it."""
  saved_config = from_saved(meta["config"]) if meta["config"].get("run", {}).get("stages") else None
  if saved_config is not None or config.run.stages:
    before, after = _boundaries(saved_config, step), _boundaries(config, step)
    if before != after:
      raise CheckpointError(f"run.stages ends stages at steps {after or 'none'} before step {step}, but the run that "
                            f"saved {step_path} ended them at {before or 'none'}; keep the stages up to step {step} "
                            "as they were (later ones may change), or use a new run.output_dir.")
  saved = fingerprint(stages.stage_config(saved_config, step).to_dict() if saved_config else meta["config"])
  now = fingerprint(stages.stage_config(config, step).to_dict())
  for key in now:
    if saved[key] != now[key]:
      # Parameters still fit a model of the same shape, so a changed data or seed setting can start from them.
      reuse = "" if key.startswith("model.") or key == CLIPS else \
          f" (with checkpoint.load_params={step_path} to start from their parameters)"
      raise CheckpointError(f"{where} holds checkpoints of another run ({key} was {excerpt(saved[key])}, this run "
                            f"has {excerpt(now[key])}); use a new run.output_dir{reuse} or move them away.")
  if meta.get("processes", 1) != jax.process_count():
    raise CheckpointError(
        f"checkpoint step {step} in {where} was saved by {meta.get('processes')} processes and this run has "
        f"{jax.process_count()}; the data position is kept per process, so resume with the same process count, or "
        f"start a new run from its parameters with checkpoint.load_params={step_path}.")
