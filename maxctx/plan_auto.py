"""`attention.strategy: auto`: `maxctx.train` asks the planner (measured mode, maxctx.plan) for a strategy and split
before it validates the run, and a resumed run keeps the plan its run directory's config.yml saved."""

from __future__ import annotations

import logging
import pathlib

import numpy as np

from maxctx import attention
from maxctx import config as config_lib
from maxctx import mesh as mesh_lib
from maxctx import plan as plan_lib
from maxctx import resume_match
from maxctx import trainer as trainer_lib
from maxctx.bench import plan as cases_lib
from maxctx.config import MESH_AXES, Config
from maxctx.errors import ConfigError

log = logging.getLogger("maxctx.plan")

# The keys `attention.strategy: auto` sets: what a candidate is (maxctx.train keeps them when it resumes).
PLANNED = ("attention.strategy", "attention.ulysses_degree",
           *(f"mesh.{level}.{a}" for level in ("ici", "dcn") for a in MESH_AXES))
AUTO_STEPS = 2   # timed steps per candidate when maxctx.train resolves `auto` (after one warm-up and one profiled)


def resolve(config: Config, devices, saved: pathlib.Path | None = None) -> Config:
  """`config` with `attention.strategy: auto` replaced by a plan for these devices (any other config as it is).

  The plan saved in `saved` (the run directory's config.yml, written by the run being resumed) is kept when it is for
  the same sequence length and still valid on these devices, so a resumed run never changes plan. Otherwise every
  candidate at data.seq_len (every strategy, every split of the fsdp × context devices, the run's remat) is measured
  for a few steps on the devices present, and the fastest is taken; with several processes, process 0's measurement
  decides for all."""
  if config.attention.strategy != attention.AUTO:
    return config
  import jax
  config_lib.check(config)   # a key no run can use is refused once, not as every candidate's refusal
  n, slices = len(devices), mesh_lib.num_slices_of(devices)
  if (kept := _saved_plan(config, saved, n, slices)) is not None:
    return kept
  strategies = cases_lib.parse_strategies(cases_lib.DEFAULT_STRATEGIES)
  cands = plan_lib.candidates(config, strategies, config.data.seq_len, [config.model.remat], n, slices)
  valid = [c for c in cands if c.case.config is not None]
  if not valid:
    raise ConfigError(f"attention.strategy auto found no strategy that can run this config on {n} devices, e.g. "
                      f"{cands[0].label}: {cands[0].case.refused}")
  log.info("attention.strategy auto: measuring %d candidates (%d refused) on the %d devices present, %d timed steps "
           "each", len(valid), len(cands) - len(valid), n, AUTO_STEPS)
  data_log = logging.getLogger("maxctx.data")
  level = data_log.level
  data_log.setLevel(logging.WARNING)   # each candidate's pipeline would log its set-up again
  try:
    ranked = plan_lib.rank(cands, plan_lib.measure_all(cands, AUTO_STEPS))
  finally:
    data_log.setLevel(level)
  ok = [(c, r) for c, r in ranked if r.status == "ok"]
  if not ok:
    raise ConfigError(f"attention.strategy auto: no candidate ran on these devices, e.g. {ranked[0][0].label}: "
                      f"{ranked[0][1].reason}; name a strategy and a mesh instead.")
  best = ok[0][0]
  if jax.process_count() > 1:   # timings differ between processes; all must run process 0's choice
    from jax.experimental import multihost_utils
    best = cands[int(multihost_utils.broadcast_one_to_all(np.int32(cands.index(best))))]
  rec = dict(ranked)[best]
  others = [(c, r) for c, r in ok if c is not best]
  runner = f"; runner-up {others[0][0].label} ({others[0][1].tokens_per_s:,.0f} tokens/s)" if others else ""
  log.info("attention.strategy auto chose %s (measured: %s tokens/s, the fastest of %d)%s", best.label,
           f"{rec.tokens_per_s:,.0f}", len(ok), runner)
  return config.replace(**{k: v for k, v in best.overrides.items() if k in PLANNED})


def _saved_plan(config: Config, saved: pathlib.Path | None, n: int, slices: int) -> Config | None:
  """`config` with the planned keys of the config saved at `saved`, if that is a plan this run may keep."""
  if saved is None or not saved.is_file():
    return None
  try:
    old = config_lib.load(saved)
  except ConfigError as e:
    log.info("attention.strategy auto: %s is not a config this run can read (%s); planning anew", saved, e)
    return None
  if old.data.seq_len != config.data.seq_len:
    log.info("attention.strategy auto: %s is for data.seq_len %d, not %d; planning anew", saved, old.data.seq_len,
             config.data.seq_len)
    return None
  flat = resume_match.flat(old.to_dict())
  kept = config.replace(**{k: flat[k] for k in PLANNED})
  try:
    trainer_lib.validate(kept, n, slices)
  except ConfigError as e:
    log.info("attention.strategy auto: the plan saved in %s cannot run on these devices (%s); planning anew", saved, e)
    return None
  sizes = cases_lib.describe(kept, n, slices)
  log.info("attention.strategy auto: keeping the plan saved in %s: %s, %s", saved, kept.attention.strategy, sizes)
  return kept
