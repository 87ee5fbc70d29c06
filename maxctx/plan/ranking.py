"""How the planner ranks what it found: which records can be the plan (`chosen`), and every candidate in order (`rank`)
-- best first, whether measured (most tokens/s) or estimated for a slice (least estimated step time)."""

from __future__ import annotations

from maxctx.bench import cases as cases_lib
from maxctx.bench import report
from maxctx.plan.candidates import Candidate


def record(cand: Candidate) -> report.Record:
  """A candidate's record before it is measured or estimated: refused with validate's sentence, or empty."""
  rec = report.Record(strategy=cand.strategy, seq_len=cand.case.seq_len, length=cases_lib.tokens(cand.case.seq_len))
  if cand.case.refused:
    rec.set(status="refused", reason=cand.case.refused)
  return rec


def chosen(rec: report.Record) -> bool:
  """Whether a candidate's record can be the plan: it ran (measured) or it fits (estimated)."""
  return rec.status == "ok" or (rec.status == "estimate" and bool(rec.fits))


def _order(rec: report.Record) -> tuple:
  if rec.status == "ok":   # those timed twice first (measure_all), then by tokens/s
    return (0, -(rec.timed_rounds or 1), -(rec.tokens_per_s or 0))
  if chosen(rec):
    # The roofline ties strategies that are compute-bound alike: then one that keeps nothing in host memory (remat
    # full_offload's copies to and from it take PCIe time the roofline does not count), then the least memory.
    step = rec.est_step_s if rec.est_step_s is not None else float("inf")
    return (0, step, (rec.memory_compiled.get("host_temp") or 0) > 0, rec.memory_compiled["total"])
  if rec.status in ("estimate", "does_not_fit"):   # closest to fitting first
    return (1, rec.over_bytes if rec.over_bytes is not None else float("inf"))
  if rec.status == "missing":   # not compiled: in the cost model's order
    over = (rec.model_memory_total or float("inf")) > (rec.hbm_per_device_bytes or 0)
    return (2, over, rec.model_step_s or float("inf"), (rec.model_host or 0) > 0,
            rec.model_memory_total or float("inf"))
  return (3,) if rec.status != "refused" else (4,)


def rank(cands: list[Candidate], records: list[report.Record]) -> list[tuple[Candidate, report.Record]]:
  """The candidates that ran or fit, best first (measured: most tokens/s; estimated: least estimated step time);
  then those that do not fit, closest first; then those that failed or were not compiled; then those refused."""
  measured = dict(zip([c for c in cands if c.case.config is not None], records))
  rows = [(c, measured.get(c) or record(c)) for c in cands]
  return sorted(rows, key=lambda cr: _order(cr[1]))
