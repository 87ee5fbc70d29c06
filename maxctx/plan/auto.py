"""`attention.strategy: auto` and `model.remat: auto`: `maxctx.train` asks the planner (measured mode)
for a strategy and split, a remat policy or both before it validates the run, and a resumed run keeps the plan its run
directory's config.yml saved; `maxctx.compile` asks the planner for its TPU slice (topology mode: the cost model,
then compiles until one fits)."""

from __future__ import annotations

import dataclasses
import logging
import pathlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from maxctx import attention
from maxctx import config as config_lib
from maxctx import mesh as mesh_lib
from maxctx import resume_match
from maxctx import topology as topology_lib
from maxctx import trainer as trainer_lib
from maxctx.bench import aot
from maxctx.bench import cases as cases_lib
from maxctx.compile.report import CompileReport
from maxctx.config import MESH_AXES, Config
from maxctx.errors import ConfigError
from maxctx.plan import candidates as plan_candidates
from maxctx.plan import estimated, measured, tables
from maxctx.plan.ranking import chosen, rank

log = logging.getLogger("maxctx.plan")

# The keys `attention.strategy: auto` sets: what a candidate is (maxctx.train keeps them when it resumes); and the one
# `model.remat: auto` sets.
PLANNED = ("attention.strategy", "attention.ulysses_degree",
           *(f"mesh.{level}.{a}" for level in ("ici", "dcn") for a in MESH_AXES))
REMAT = "model.remat"
REMAT_GROUP = "model.remat_group"   # set with it: 1 under a policy that does not group layers
AUTO_STEPS = 2   # timed steps per candidate when maxctx.train resolves `auto` (after one warm-up and one profiled)
AUTO_COMPILES = 1   # candidates maxctx.compile compiles when it resolves `auto` for a slice (then only until one fits)


def planned_keys(config: Config) -> tuple[str, ...]:
  """The keys this run leaves to the planner (those a resumed run takes from the plan it saved)."""
  return ((PLANNED if config.attention.strategy == attention.AUTO else ())
          + ((REMAT, REMAT_GROUP) if config.model.remat == plan_candidates.AUTO else ()))


def is_auto(config: Config) -> bool:
  return bool(planned_keys(config))


def _what(config: Config) -> str:
  return " and ".join(f"{k} auto" for k in ("attention.strategy", REMAT) if k in planned_keys(config))


def _candidates(config: Config, n: int, slices: int, platform: str | None = None) -> list[plan_candidates.Candidate]:
  """What the planner tries for this run: with `attention.strategy: auto` every strategy and split of the fsdp ×
  context devices, else the run's strategy on its mesh; under every remat policy with `model.remat: auto` (for a
  slice, `full` and `full_offload` also in pairs of layers), else the run's; with the run's MLP chunk."""
  remat_auto = config.model.remat == plan_candidates.AUTO
  remats = list(plan_candidates.REMATS) if remat_auto else [config.model.remat]
  # With `model.remat: auto` for a slice, layer groups as `maxctx.plan --topology` tries them; else the run's group.
  groups = plan_candidates.remat_group_flag(None, config, topology=remat_auto and platform == "tpu")
  seq_len = config.data.seq_len
  if config.attention.strategy == attention.AUTO:
    strategies = cases_lib.parse_strategies(cases_lib.DEFAULT_STRATEGIES)
    return plan_candidates.candidates(config, strategies, seq_len, remats, n, slices, platform=platform,
                                      groups=groups)
  out = []
  for remat, group in plan_candidates.remats_with_groups(remats, groups):
    case = cases_lib.configure(config.replace(**{REMAT: remat, REMAT_GROUP: group}),
                               config.attention.strategy, seq_len, n, slices, platform=platform)
    context = case.config.mesh.ici.context * case.config.mesh.dcn.context if case.config else 0
    out.append(plan_candidates.Candidate(config.attention.strategy, context, config.attention.ulysses_degree, remat,
                                         config.model.mlp_chunk, case, remat_group=group))
  return out


def resolve(config: Config, devices, saved: pathlib.Path | None = None) -> Config:
  """`config` with `attention.strategy: auto` and `model.remat: auto` replaced by a plan for these devices (any other
  config as it is).

  The plan saved in `saved` (the run directory's config.yml, written by the run being resumed) is kept when it is for
  the same sequence length and still valid on these devices, so a resumed run never changes plan. Otherwise every
  candidate at data.seq_len (`_candidates`) is measured for a few steps on the devices present, and the fastest is
  taken; with several processes, process 0's measurement decides for all."""
  if not is_auto(config):
    return config
  config_lib.check(config)   # a key no run can use is refused once, not as every candidate's refusal
  what = _what(config)
  n, slices = len(devices), mesh_lib.num_slices_of(devices)
  if (kept := _saved_plan(config, saved, n, slices)) is not None:
    return kept
  cands = _candidates(config, n, slices)
  valid = [c for c in cands if c.case.config is not None]
  if not valid:
    raise ConfigError(f"{what} found no candidate that can run this config on {n} devices, e.g. "
                      f"{cands[0].label}: {cands[0].case.refused}")
  log.info("%s: measuring %d candidates (%d refused) on the %d devices present, %d timed steps each", what,
           len(valid), len(cands) - len(valid), n, AUTO_STEPS)
  data_log = logging.getLogger("maxctx.data")
  level = data_log.level
  data_log.setLevel(logging.WARNING)   # each candidate's pipeline would log its set-up again
  try:
    ranked = rank(cands, measured.measure_all(cands, AUTO_STEPS))
  finally:
    data_log.setLevel(level)
  ok = [(c, r) for c, r in ranked if r.status == "ok"]
  if not ok:
    raise ConfigError(f"{what}: no candidate ran on these devices, e.g. {ranked[0][0].label}: "
                      f"{ranked[0][1].reason}; name a strategy, a mesh and a remat policy instead.")
  best = ok[0][0]
  if jax.process_count() > 1:   # timings differ between processes; all must run process 0's choice
    best = cands[int(multihost_utils.broadcast_one_to_all(np.int32(cands.index(best))))]
  rec = dict(ranked)[best]
  others = [(c, r) for c, r in ok if c is not best]
  runner = f"; runner-up {others[0][0].label} ({others[0][1].tokens_per_s:,.0f} tokens/s)" if others else ""
  log.info("%s chose %s (measured: %s tokens/s, the fastest of %d)%s", what, best.label,
           f"{rec.tokens_per_s:,.0f}", len(ok), runner)
  return _apply(config, best)


def _apply(config: Config, best: plan_candidates.Candidate) -> Config:
  keys = planned_keys(config)
  return config.replace(**{k: v for k, v in best.overrides.items() if k in keys})


def resolve_for_slice(config: Config, out: pathlib.Path) -> tuple[Config, CompileReport]:
  """(`config` with `attention.strategy: auto` and `model.remat: auto` replaced by the plan for its compile.topology,
  the chosen candidate's compile report): the candidates of `_candidates`, estimated by the cost model and compiled in
  its order as `python -m maxctx.plan --topology` does (AUTO_COMPILES, then only until one fits), compiles cached
  under `out`. Nothing fitting is a ConfigError naming the candidate that came closest."""
  config_lib.check(config)
  what = _what(config)
  topo = topology_lib.resolve(config.compile.topology)
  slices = config.compile.num_slices
  n = topo.devices * slices
  cands = _candidates(config, n, slices, platform="tpu")
  valid = [c for c in cands if c.case.config is not None]
  if not valid:
    raise ConfigError(f"{what} found no candidate that can run this config on {topo.name}, e.g. "
                      f"{cands[0].label}: {cands[0].case.refused}")
  log.info("%s: estimating %d candidates (%d refused) for %s, compiling the best %d (cached in %s)", what,
           len(valid), len(cands) - len(valid), topo.name, AUTO_COMPILES, out)
  ranked = rank(cands, estimated.estimate_all(cands, n, slices, out, [], True, AUTO_COMPILES))
  if not chosen(ranked[0][1]):
    # Not maxctx.plan's --remat; and nothing to suggest where `model.remat: auto` tried every policy.
    keeps_less = None if REMAT in planned_keys(config) else "model.remat: full or full_offload in the run file"
    raise ConfigError(f"{what} on {topo.name}: {tables.verdict(ranked, keeps_less)}")
  best = ranked[0][0]
  log.info("%s: %s", what, tables.verdict(ranked).replace("**", ""))
  report, _ = aot.report_for(best.case, mesh_lib.axis_sizes(best.case.config.mesh, n, slices), out, [], False)
  # The report of the plan's own compile, named for this run rather than for the planner's case.
  return _apply(config, best), dataclasses.replace(report, config=config.run.name)


def _saved_plan(config: Config, saved: pathlib.Path | None, n: int, slices: int) -> Config | None:
  """`config` with the planned keys of the config saved at `saved`, if that is a plan this run may keep."""
  if saved is None or not saved.is_file():
    return None
  what = _what(config)
  try:
    old = config_lib.load(saved)
  except ConfigError as e:
    log.info("%s: %s is not a config this run can read (%s); planning anew", what, saved, e)
    return None
  if old.data.seq_len != config.data.seq_len:
    log.info("%s: %s is for data.seq_len %d, not %d; planning anew", what, saved, old.data.seq_len,
             config.data.seq_len)
    return None
  flat = resume_match.flat(old.to_dict())
  kept = config.replace(**{k: flat[k] for k in planned_keys(config)})
  if is_auto(kept):   # e.g. a config.yml that was never planned
    return None
  try:
    trainer_lib.validate(kept, n, slices)
  except ConfigError as e:
    log.info("%s: the plan saved in %s cannot run on these devices (%s); planning anew", what, saved, e)
    return None
  sizes = cases_lib.describe(kept, n, slices)
  log.info("%s: keeping the plan saved in %s: %s, %s, remat %s", what, saved, kept.attention.strategy, sizes,
           kept.model.remat)
  return kept
