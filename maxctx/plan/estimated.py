"""The planner's topology mode (--topology): nothing runs. Every valid candidate is estimated by the cost model
(maxctx.plan.cost_model), then compiled for the slice in the model's order until one fits (maxctx.bench.aot, which
caches compiles and reuses maxctx.compile reports); each compiled candidate is estimated by maxctx.bench's
roofline."""

from __future__ import annotations

import logging
import pathlib

from maxctx import chips as chips_lib
from maxctx import mesh as mesh_lib
from maxctx import topology as topology_lib
from maxctx.bench import aot, report
from maxctx.plan import cost_model, tables
from maxctx.plan.candidates import Candidate
from maxctx.plan.ranking import chosen, record

log = logging.getLogger("maxctx.plan")


# A candidate expected this far over HBM is not compiled: on the compiled steps the model was checked against
# (docs/planner.md, "How far to trust the cost model") it was at most 11% over the compiler's total.
NOT_WORTH_COMPILING = 1.25


def estimate_all(cands: list[Candidate], n: int, slices: int, out: pathlib.Path, reports: list[pathlib.Path],
                 compile_missing: bool, budget: int) -> list[report.Record]:
  """Estimates every valid candidate with the cost model, then takes them in its order -- least
  estimated step time among those expected to fit, then least memory -- and compiles each for the topology in its
  config: `budget` compiles, past that only until one fits (0: every candidate). The memory expected of a candidate is
  the model's, scaled by the largest compiled / modelled ratio seen so far under its remat policy and layer group (the
  model errs most in what a policy saves), so one compile that does not fit spares its siblings. A candidate whose
  offloaded layer inputs would fill more than HOST_MEMORY_SHARE of a host VM's RAM is not compiled (the model's host
  bytes are the compiler's). Reports are cached under `out` or taken from `reports`; a candidate with one is estimated
  by maxctx.bench's roofline from it. Logs each."""
  valid = [c for c in cands if c.case.config is not None]
  topo = topology_lib.resolve(valid[0].case.config.compile.topology) if valid else None
  sizes = {c: mesh_lib.axis_sizes(c.case.config.mesh, n, slices) for c in valid}
  model = {c: cost_model.estimate(c.case.config, sizes[c], topo) for c in valid}
  hbm = topo.hbm_bytes if topo else 0
  ratio: dict[tuple[str, int], float] = {}   # (remat, remat group) -> compiled / modelled memory, the largest seen
  # What full_offload keeps in a host VM's RAM is exactly its saved inputs (the model's figure is the compiler's), so
  # a candidate over maxctx.train's share of that RAM is not compiled.
  per_host = (topo.devices_per_host or 0) if topo else 0
  ram = (topo.generation.chip.host_ram_bytes or 0) if topo else 0

  def expected(c: Candidate) -> float:
    return model[c].total * ratio.get(c.policy, 1.0)

  def host_over(c: Candidate) -> bool:
    return bool(per_host and ram) and model[c].host * per_host > chips_lib.HOST_MEMORY_SHARE * ram

  records, left, compiled, fitting = {}, list(valid), 0, 0
  while left:
    cand = min(left, key=lambda c: (expected(c) > hbm or host_over(c), model[c].step_s, model[c].host > 0,
                                    expected(c)))
    left.remove(cand)
    est, want = model[cand], expected(cand)
    may_compile = compile_missing and (not budget or want <= NOT_WORTH_COMPILING * hbm and not host_over(cand)
                                       and (compiled < budget or not fitting))
    rec = record(cand).set(mesh=sizes[cand], hbm_per_device_bytes=hbm, **est.fields())
    rec.set(**aot.record(cand.case, sizes[cand], out, reports, may_compile))
    compiled += (rec.source or "").startswith("compiled")
    fitting += chosen(rec)
    if rec.memory_compiled:
      ratio[cand.policy] = max(ratio.get(cand.policy, 0.0), rec.memory_compiled["total"] / est.total)
    if rec.status == "missing" and compile_missing and budget and want > NOT_WORTH_COMPILING * hbm:
      scaled = (f" (the cost model's {est.total / 2**30:.1f} × {ratio[cand.policy]:.2f}, as compiled under "
                f"{cand.remat_label})" if cand.policy in ratio else "")
      rec.set(reason=f"{tables.HBM_OVER} {want / 2**30:.1f} GiB per device of {hbm / 2**30:.1f} GiB "
                     f"HBM{scaled}")
    elif rec.status == "missing" and compile_missing and budget and host_over(cand):
      rec.set(reason=f"{tables.HOST_OVER} {est.host * per_host / 2**30:.1f} GiB of saved layer inputs "
                     f"in each host VM's memory, over {chips_lib.HOST_MEMORY_SHARE:.0%} of its "
                     f"{ram / 1e9:.0f} GB")
    elif rec.status == "missing" and compile_missing and budget:
      rec.set(reason=f"not compiled: ranked below the {compiled} compiled (--compile {budget})")
    memory = (f"{rec.memory_compiled['total'] / 2**30:.1f} GiB compiled, " if rec.memory_compiled else "")
    log.info("[%d/%d] %s at %s: %smodel %.1f GiB, est. step %.3g s: %s", len(records) + 1, len(valid), cand.label,
             rec.length, memory, est.total / 2**30, rec.est_step_s or est.step_s,
             "fits" if chosen(rec) else rec.reason or rec.status)
    records[cand] = rec
  return [records[c] for c in valid]
