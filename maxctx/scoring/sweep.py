"""A sweep: tasks × lengths × depths × samples (plus local task files), generated, checked and scored.

Everything a user can get wrong (task names, lengths the mesh cannot split or the task cannot fit, a tokenizer that
does not fit the model, unreadable task files) is found when the sweep is built, before anything compiles: every
example is generated up front, which costs milliseconds per example.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

from jax.sharding import Mesh

from maxctx.config import Config
from maxctx.errors import ConfigError
from maxctx.data import tasks
from maxctx.data.dataset import tokenizer_for
from maxctx.scoring import forward, local
from maxctx.lengths import parse_lengths

log = logging.getLogger("maxctx.eval")


def parse_depths(text: str, where: str) -> list[float]:
  out = []
  for part in (p.strip() for p in text.split(",") if p.strip()):
    try:
      d = float(part)
    except ValueError:
      d = -1.0
    if not 0.0 <= d <= 1.0:
      raise ConfigError(f"{where} has depth {part!r}; depths are fractions of the filler in [0, 1], e.g. 0,0.5,1.")
    out.append(d)
  return out


def parse_tasks(text: str, where: str) -> list[str]:
  names = [p.strip() for p in text.split(",") if p.strip()]
  tasks.check_tasks(names, where)
  return names


@dataclasses.dataclass(frozen=True)
class Plan:
  """What to score. Built from the `eval` section; the command line's flags replace its keys."""
  tasks: tuple[str, ...]
  lengths: tuple[int, ...]
  depths: tuple[float, ...]
  samples: int
  files: tuple[str, ...]
  seed: int
  batch_size: int

  @classmethod
  def from_config(cls, config: Config, *, tasks: str | None = None, lengths: str | None = None,
                  depths: str | None = None, samples: int | None = None, files: str | None = None) -> Plan:
    e = config.eval
    # Messages name where a value came from: the flag if one was given, else the config key.
    tasks, t_where = (e.tasks, "eval.tasks") if tasks is None else (tasks, "--tasks")
    lengths, l_where = (e.lengths, "eval.lengths") if lengths is None else (lengths, "--lengths")
    depths, d_where = (e.depths, "eval.depths") if depths is None else (depths, "--depths")
    plan = cls(
        tasks=tuple(parse_tasks(tasks, t_where)),
        lengths=tuple(parse_lengths(lengths, l_where) if lengths.strip() else [config.data.seq_len]),
        depths=tuple(parse_depths(depths, d_where)),
        samples=e.samples if samples is None else samples,
        files=tuple(p.strip() for p in (e.files if files is None else files).split(",") if p.strip()),
        seed=e.seed, batch_size=e.batch_size)
    if plan.samples < 1:
      raise ConfigError(f"eval samples is {plan.samples}; score at least one example per cell (--samples N).")
    if plan.tasks and not plan.depths:
      raise ConfigError("eval depths are empty; give at least one needle depth, e.g. --depths 0,0.5,1.")
    if not plan.tasks and not plan.files:
      raise ConfigError("there is nothing to evaluate; name tasks (--tasks passkey) or task files (--files a.jsonl).")
    return plan


class Sweep:
  """The examples of a plan for a run, and the scorer that runs them on the run's mesh."""

  def __init__(self, config: Config, mesh: Mesh, plan: Plan, scorer: forward.Scorer | None = None):
    self.config, self.plan = config, plan
    self.tokenizer = tokenizer_for(config, writes_text=True)
    pieces = tasks.Pieces(self.tokenizer)
    # Sweeps of one run can share a scorer, and with it the compiled forward of each length.
    self.scorer = scorer or forward.Scorer(config, mesh, rows=plan.batch_size)
    for n in plan.lengths:
      self.scorer.seq_len_for(n, exact=True)  # refuses lengths the context axis cannot split
    self.examples = tasks.sweep(plan.tasks, plan.lengths, plan.depths, plan.samples, pieces, plan.seed)
    self.file_examples = [e for f in plan.files for e in local.read(f, pieces)]
    log.info("eval: %d generated examples (%s at %s tokens, depths %s, %d each) and %d from task files",
             len(self.examples), ",".join(plan.tasks), ",".join(map(str, plan.lengths)),
             ",".join(f"{d:g}" for d in plan.depths), plan.samples, len(self.file_examples))

  def run(self, params) -> list[dict]:
    start = time.monotonic()
    records = self.scorer.score(params, self.examples, exact=True)
    if self.file_examples:
      records += self.scorer.score(params, self.file_examples, exact=False)
    log.info("eval: scored %d examples in %.1fs", len(records), time.monotonic() - start)
    return records


def accuracy(records: Sequence[dict]) -> dict[tuple[str, int], float]:
  """Mean accuracy per (task, length): the mean recall, RULER's score (for a one-part answer, the share right)."""
  cells: dict[tuple[str, int], list[float]] = {}
  for r in records:
    cells.setdefault((r["task"], r["length"]), []).append(r["recall"])
  return {k: sum(v) / len(v) for k, v in cells.items()}


def scalars(records: Sequence[dict]) -> dict[str, float]:
  """TensorBoard scalars `eval/<task>/<length>` (accuracy over depths) for generated tasks, and per file."""
  out = {}
  for (task, length), acc in accuracy([r for r in records if r["depth"] >= 0]).items():
    out[f"eval/{task}/{length}"] = acc
  files: dict[str, list[float]] = {}
  for r in records:
    if r["depth"] < 0:
      files.setdefault(r["task"], []).append(r["recall"])
  out.update({f"eval/{task}/all": sum(v) / len(v) for task, v in files.items()})
  return out


def during_training(config: Config, mesh: Mesh) -> Sweep | None:
  """The sweep the training loop runs every eval.every_steps steps and, with eval.at_stage_end, at each stage's end
  (None when neither); built before compiling."""
  if config.eval.every_steps <= 0 and not config.eval.at_stage_end:
    return None
  return Sweep(config, mesh, Plan.from_config(config))


def summary(records: Sequence[dict]) -> str:
  """One line: accuracy per task and length, for logs."""
  acc = accuracy(records)
  return "; ".join(f"{t}@{n}: {100 * a:.0f}%" for (t, n), a in sorted(acc.items(), key=lambda kv: (kv[0][0], kv[0][1])))
