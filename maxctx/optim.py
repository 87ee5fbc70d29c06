"""AdamW with linear warm-up, cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax

from maxctx.config import OptimConfig


def schedule(cfg: OptimConfig, total_steps: int, start: int = 0) -> optax.Schedule:
  """Warm-up then cosine decay over `total_steps` updates counted from update `start` (a stage that resets the
  schedule: maxctx.stages)."""
  decay = cfg.decay_steps or max(1, total_steps - cfg.warmup_steps)
  curve = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
      decay_steps=cfg.warmup_steps + decay, end_value=cfg.lr * cfg.min_lr_ratio)
  return curve if start == 0 else (lambda count: curve(count - start))


def _decay_mask(params):
  # Norm scales are not decayed: shrinking them towards zero fights the normalisation they exist for.
  def keep(path, _):
    return not any(getattr(p, "key", None) in ("scale",) for p in path)
  return jax.tree_util.tree_map_with_path(keep, params)


def build(cfg: OptimConfig, total_steps: int, start: int = 0) -> optax.GradientTransformation:
  parts = []
  if cfg.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(cfg.clip_norm))
  parts.append(optax.adamw(schedule(cfg, total_steps, start), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, mask=_decay_mask))
  return optax.chain(*parts)


def updates_done(state) -> jax.Array:
  """The updates the optimizer has applied: its schedule's own count, which a step skipped under run.on_nan=skip
  does not advance (the state's step does), so the learning rate logged is the one the next update uses."""
  counts = [s.count for s in jax.tree.leaves(state.opt_state, is_leaf=_is_schedule_state)
            if _is_schedule_state(s)]
  return counts[0] if counts else state.step


def _is_schedule_state(x) -> bool:
  return isinstance(x, optax.ScaleByScheduleState)
