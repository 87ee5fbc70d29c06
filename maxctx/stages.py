"""Length stages in one run (run.stages): which stage runs which steps, each stage's whole config, and the refusals
of a schedule no run can follow.

A stage is the config of the stage before it (the run's, for the first) with the keys it sets
(maxctx.config_stages.STAGE_KEYS); stage i runs steps
[start_i, end_i), end_i = start_i + its steps, and run.steps is the last end. What a stage may not change carries
over: the parameters (a RoPE change applies to the same weights), the optimizer state, and each batch row's document
stream, which the next stage packs at its own length from where the last one stopped (maxctx.data). A run without
stages is one stage: the config itself.
"""

from __future__ import annotations

import contextlib
import dataclasses

from maxctx import attention
from maxctx.config import Config
from maxctx.data import GENERATED
from maxctx.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Stage:
  index: int
  start: int            # the first step it runs (0-based, = steps done before it)
  end: int              # steps done when it ends
  config: Config        # the run's config with the keys of this stage and those before it set (run.stages empty)
  reset_schedule: bool  # the learning-rate schedule starts afresh at `start`

  @property
  def name(self) -> str:
    return f"run.stages[{self.index}]"


def resolve(config: Config) -> tuple[Stage, ...]:
  """The run's stages in order (one, the config itself, without run.stages)."""
  if not config.run.stages:
    return (Stage(0, 0, config.run.steps, config, False),)
  out, start = [], 0
  for i, spec in enumerate(config.run.stages):
    staged = config.with_stage(i)
    staged = dataclasses.replace(staged, run=dataclasses.replace(staged.run, stages=()))
    out.append(Stage(i, start, start + spec.steps, staged, spec.reset_schedule))
    start += spec.steps
  return tuple(out)


def at(stages: tuple[Stage, ...], step: int) -> Stage:
  """The stage that runs step `step` (0-based), i.e. continues a state after `step` steps; the last past the end."""
  return next((s for s in stages if step < s.end), stages[-1])


def producer(stages: tuple[Stage, ...], done: int) -> Stage:
  """The stage whose steps made a state after `done` steps (the first for a state of no steps)."""
  return at(stages, max(done - 1, 0))


def stage_config(config: Config, done: int) -> Config:
  """The whole config of the stage that made a state after `done` steps (what computed it: its RoPE, its length)."""
  return producer(resolve(config), done).config


def ends(config: Config) -> frozenset[int]:
  """The steps at which a stage ends (a checkpoint is saved there)."""
  return frozenset(s.end for s in resolve(config)) if config.run.stages else frozenset()


def check(config: Config) -> tuple[Stage, ...]:
  """Refuses a stage schedule no run can follow, in one sentence naming the stage; returns the stages. Each stage's
  own config is checked against the devices by maxctx.trainer.validate."""
  specs = config.run.stages
  if not specs:
    return resolve(config)
  total = sum(s.steps for s in specs)
  if config.run.steps != total:
    raise ConfigError(f"run.steps is {config.run.steps} but run.stages trains {total} steps; leave run.steps out of "
                      f"a run with stages (it is their sum) or set run.steps: {total}.")
  if config.data.num_workers:
    raise ConfigError("run.stages needs data.num_workers: 0: worker processes hold the document streams in a form "
                      "the next stage cannot continue at its own length; use data.prefetch for a reading thread.")
  stages = resolve(config)
  first = stages[0].config
  for s in stages:
    c, where = s.config, f"{s.name} (steps {s.start}–{s.end})"
    if attention.AUTO in (c.attention.strategy,) or c.model.remat == "auto":
      raise ConfigError(f"{where} leaves attention.strategy or model.remat at auto, which is planned for one length; "
                        "name them per stage (python -m maxctx.plan CONFIG run.stages=[] data.seq_len=N suggests "
                        "them).")
    if s.index == 0:
      continue
    before = stages[s.index - 1].config
    if c.data.seq_len < before.data.seq_len:
      raise ConfigError(f"{where} sets data.seq_len {c.data.seq_len}, shorter than the {before.data.seq_len} of the "
                        "stage before it; stages extend the context, so give each a length at least the last one's.")
    if c.data.batch_size != first.data.batch_size and c.data.source not in GENERATED:
      raise ConfigError(f"{where} sets data.batch_size {c.data.batch_size} but the first stage has "
                        f"{first.data.batch_size}: each batch row reads its own slice of the documents, which a "
                        "different row count would reread; keep data.batch_size and change optim.grad_accum instead.")
    same = [(m.source, m.path, m.name, m.text_field, m.text_separator) for m in c.data.mixture]
    if same != [(m.source, m.path, m.name, m.text_field, m.text_separator) for m in first.data.mixture]:
      raise ConfigError(f"{where} sets a data.mixture with other sources than the first stage's; a stage may change "
                        "only the weights, so list the same sources (source, path, name, text fields) in the same "
                        "order.")
  return stages


def schedule_span(stages: tuple[Stage, ...], stage: Stage) -> tuple[int, int]:
  """(first update, updates) of the learning-rate schedule that `stage` follows: one schedule over the whole run, or,
  from each stage that resets it, one over its steps up to the next reset (or the end)."""
  resets = [s.start for s in stages if s.reset_schedule or s.index == 0]
  start = max(r for r in resets if r <= stage.start)
  end = min([r for r in resets if r > stage.start] + [stages[-1].end])
  return start, end - start


@contextlib.contextmanager
def named(stage: Stage, config: Config):
  """A ConfigError raised inside names `stage` (with run.stages; a run without them is its own stage)."""
  try:
    yield
  except ConfigError as e:
    if not config.run.stages:
      raise
    raise ConfigError(f"{stage.name} (steps {stage.start}–{stage.end}): {e}") from None
