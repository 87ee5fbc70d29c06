"""The planner's measured mode: each valid candidate trains a few steps on the devices present (maxctx.bench.measure:
the same model, data and global batch every time, so the candidates differ only in how they are split), and the
closest contenders are timed again before one is chosen."""

from __future__ import annotations

import logging
import statistics

from maxctx.bench import report
from maxctx.plan.candidates import Candidate
from maxctx.plan.ranking import record

log = logging.getLogger("maxctx.plan")


# Measured candidates with at least this share of the fastest's tokens/s (within issue 18's 15%) are timed a second
# time before one is chosen: on the 2-core CPU host the same candidate was seen 27% apart in two processes
# (docs/results.md, "The measured planner on the CPU host"), so a first-round lead that small is no evidence. At most
# RETIME_MAX of them, to bound the time a plan takes.
RETIME_RATIO = 0.85
RETIME_MAX = 3


def _close(records: list[report.Record]) -> list[int]:
  """Indices of the records within RETIME_RATIO of the fastest, fastest first, at most RETIME_MAX. With several
  processes, process 0's: every process must train the same candidates, since a step's collectives span them all."""
  ok = [i for i, r in enumerate(records) if r.status == "ok"]
  fastest = max((records[i].tokens_per_s for i in ok), default=0.0)
  close = sorted((i for i in ok if records[i].tokens_per_s >= RETIME_RATIO * fastest),
                 key=lambda i: -records[i].tokens_per_s)[:RETIME_MAX]
  import jax
  if jax.process_count() > 1:
    import numpy as np
    from jax.experimental import multihost_utils
    mine = np.full(RETIME_MAX, -1, np.int32)
    mine[:len(close)] = close
    close = [int(i) for i in multihost_utils.broadcast_one_to_all(mine) if i >= 0]
  return close


def measure_all(cands: list[Candidate], steps: int) -> list[report.Record]:
  """Trains each valid candidate for 1 warm-up + `steps` timed + 1 profiled step; logs each as it finishes. Then the
  closest contenders (within RETIME_RATIO of the fastest, at most RETIME_MAX) are trained again, in the opposite
  order, and each is ranked by the median of both rounds' timed steps: the second round runs them back to back, and
  the reversed order lets neither gain from a host that slows or speeds up while the plan runs. They rank before any
  candidate timed once, which each of them beat in the round they shared (see `_order`)."""
  from maxctx.bench import measure
  records = []
  valid = [c for c in cands if c.case.config is not None]
  for i, cand in enumerate(valid, 1):
    rec = record(cand)
    rec.set(**measure.attempt(cand.case, measure.Steps(warmup=1, timed=steps, traced=1)))
    if rec.status == "ok":
      rec.set(timed_rounds=1)
      log.info("[%d/%d] %s at %s: %s tokens/s, step %.3f s", i, len(valid), cand.label, rec.length,
               f"{rec.tokens_per_s:,.0f}", rec.step_time_s)
    else:  # e.g. out of memory: this candidate does not run here
      log.info("[%d/%d] %s at %s: %s: %s", i, len(valid), cand.label, rec.length, rec.status, rec.reason)
    records.append(rec)
  close = _close(records)
  if len(close) < 2:
    return records
  log.info("timing again the %d candidates within %.0f%% of the fastest at %s, in the opposite order: %s",
           len(close), 100 * (1 - RETIME_RATIO), records[close[0]].length,
           ", ".join(valid[i].label for i in sorted(close, reverse=True)))
  for j, i in enumerate(sorted(close, reverse=True), 1):
    rec = records[i]
    again = measure.attempt(valid[i].case, measure.Steps(warmup=1, timed=steps, traced=1))
    if rec.status != "ok":   # ran here only because process 0 chose it (its steps span every process)
      continue
    if again["status"] != "ok":   # it ran once: keep that round and say why the second did not
      log.info("[again %d/%d] %s: %s: %s", j, len(close), valid[i].label, again["status"], again["reason"])
      continue
    times = rec.step_times_s + again["step_times_s"]
    step = statistics.median(times)
    log.info("[again %d/%d] %s at %s: %s tokens/s this round, %s over both", j, len(close), valid[i].label,
             rec.length, f"{again['tokens_per_s']:,.0f}", f"{rec.tokens_per_step / step:,.0f}")
    rec.set(step_times_s=times, step_time_s=step, tokens_per_s=rec.tokens_per_step / step, timed_rounds=2)
  return records
