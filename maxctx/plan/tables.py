"""The planner's plan.md: every candidate of each length ranked, with the one sentence that says what was chosen and
why (or, when nothing fits, what came closest), for the measured and the estimated (--topology) modes."""

from __future__ import annotations

from maxctx.bench import cases as cases_lib
from maxctx.bench import report
from maxctx.plan.candidates import Candidate
from maxctx.plan.ranking import chosen

# A length's candidates, ranked: each with its record.
Rows = list[tuple[Candidate, report.Record]]


def _mib(n: int | None) -> str:
  return "—" if n is None else f"{n / 2**20:,.1f}"


def _considered(rows: Rows) -> Rows:
  return [(c, r) for c, r in rows if r.status != "refused"]


def _refused(rows: Rows) -> list[str]:
  """The refused candidates, one line per reason (a batch of one sequence refuses every split but one, so a slice's
  plan can refuse a hundred candidates for the same sentence)."""
  by_reason: dict[str, list[str]] = {}
  for cand, r in rows:
    if r.status == "refused":
      by_reason.setdefault(r.reason or "", []).append(cand.label)
  lines = [f"Refused ({sum(map(len, by_reason.values()))}), by `maxctx.trainer.validate`:", ""] if by_reason else []
  for reason, labels in by_reason.items():
    lines.append(f"- {len(labels)} candidate{'s' if len(labels) > 1 else ''} ({', '.join(labels)}): {reason}")
  return lines + ([""] if lines else [])


def markdown(ranked: dict[int, Rows], setup: str) -> str:
  lines = ["# Plan (measured)", "", setup, ""]
  for seq_len, rows in ranked.items():
    best = rows[0][1] if rows and rows[0][1].status == "ok" else None
    lines += [f"## {cases_lib.tokens(seq_len)} tokens", ""]
    if best is None:
      lines += ["No candidate ran at this length; the reasons are below.", ""]
    else:
      ok = [r for _, r in rows if r.status == "ok"]
      runner = f"; runner-up {rows[1][0].label} ({ok[1].tokens_per_s:,.0f} tokens/s)" if len(ok) > 1 else ""
      lines += [f"Chosen: **{rows[0][0].label}**, {best.tokens_per_s:,.0f} tokens/s, the fastest of {len(ok)} "
                f"measured{runner}.", ""]
    lines += ["| rank | candidate | mesh | tokens/s | step s (median) | rounds | memory per device MiB, compiled "
              "total | last loss | status |", "|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for i, (cand, r) in enumerate(_considered(rows), 1):
      mesh = (" × ".join(f"{a}={s}" for a, s in r.mesh.items() if s > 1) or "1 device") if r.mesh else "—"
      memory = _mib(r.memory_compiled["total"]) if r.memory_compiled else "—"
      status = "ok" if r.status == "ok" else f"{r.status}: {r.reason}"
      lines.append(f"| {i if r.status == 'ok' else '—'} | {cand.label} | {mesh} | "
                   f"{'—' if r.tokens_per_s is None else f'{r.tokens_per_s:,.0f}'} | "
                   f"{'—' if r.step_time_s is None else f'{r.step_time_s:.3f}'} | {r.timed_rounds or '—'} | "
                   f"{memory} | "
                   f"{'—' if r.loss is None else f'{r.loss:.6f}'} | {status} |")
    lines += ["", *_refused(rows)]
  return "\n".join(lines)


def markdown_estimated(ranked: dict[int, Rows], setup: str) -> str:
  lines = ["# Plan (estimated, compiled)", "", setup, ""]
  gib = lambda b: "—" if b is None else f"{b / 2**30:,.1f}"  # noqa: E731
  for seq_len, rows in ranked.items():
    lines += [f"## {cases_lib.tokens(seq_len)} tokens", "", verdict(rows), ""]
    estimated = [r for _, r in rows if r.model_step_s is not None]
    compiled = sum(r.memory_compiled is not None or r.status == "estimate" for r in estimated)
    if estimated:
      lines += [f"The cost model estimated {len(estimated)} candidates; {compiled} of them have a compiled step "
                "(compiled here, cached or reported), in the model's order.", ""]
    lines += ["| rank | candidate | mesh | model: GiB per device | model: step s | compiled: GiB per device | "
              "est. step s | est. MFU | HBM GiB | host GiB per device | host GiB per VM (of RAM) | status |",
              "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for i, (cand, r) in enumerate(_considered(rows), 1):
      mesh = (" × ".join(f"{a}={s}" for a, s in r.mesh.items() if s > 1) or "1 device") if r.mesh else "—"
      memory = r.memory_compiled or {}
      status = "fits" if chosen(r) else f"{r.status}: {r.reason}"
      lines.append(f"| {i if chosen(r) else '—'} | {cand.label} | {mesh} | {gib(r.model_memory_total)} | "
                   f"{'—' if r.model_step_s is None else f'{r.model_step_s:.3g}'} | {gib(memory.get('total'))} | "
                   f"{'—' if r.est_step_s is None else f'{r.est_step_s:.3g}'} | "
                   f"{'—' if r.est_mfu is None else f'{100 * r.est_mfu:.1f}%'} | "
                   f"{gib(r.hbm_per_device_bytes)} | {gib(memory.get('host_temp'))} | {_per_vm(r)} | {status} |")
    lines += ["", *_refused(rows)]
  return "\n".join(lines)


def _per_vm(r) -> str:
  if not (r.memory_compiled or {}).get("host_temp") or r.host_per_host_bytes is None:
    return "—"
  ram = f" ({r.host_ram_bytes / 2**30:,.0f})" if r.host_ram_bytes else ""
  return f"{r.host_per_host_bytes / 2**30:,.1f}{ram}"


# How maxctx.plan's reasons for a candidate it did not compile because of host memory, or of HBM (the model's figure
# scaled by what a compile taught it), begin.
HOST_OVER = "not compiled: expected to keep"
HBM_OVER = "not compiled: expected to need"


def verdict(rows: Rows, keeps_less: str | None = "--remat full,full_offload") -> str:
  """The one sentence that says what a length's plan is, or, when nothing fits, what came closest; `keeps_less` is how
  the reader asks for remat policies that keep less (maxctx.plan's flag by default; None where all were tried)."""
  fits = [(c, r) for c, r in rows if chosen(r)]
  if fits:
    (best, r), runner = fits[0], fits[1:2]
    second = (f"; runner-up {runner[0][0].label} (est. step {runner[0][1].est_step_s:.3g} s)" if runner else "")
    tied = sum(other.est_step_s <= 1.01 * r.est_step_s for _, other in fits[1:])
    if tied:   # the roofline cannot separate them: host offload and memory decided, which the reader must know
      offloads = (r.memory_compiled or {}).get("host_temp")
      second += (f"; {tied} other{'s' if tied > 1 else ''} tie{'' if tied > 1 else 's'} with it on the estimate "
                 "(within 1%), and it needs the least memory of them" + ("" if offloads else
                 " that keep nothing in host memory (whose copies the estimate does not count)"))
    return (f"Chosen: **{best.label}**, est. step {r.est_step_s:.3g} s (est. MFU {100 * r.est_mfu:.1f}%), "
            f"{r.memory_compiled['total'] / 2**30:.1f} GiB per device, the least estimated step time of {len(fits)} "
            f"that fit{second}.")
  over = [(c, r) for c, r in rows if r.status in ("estimate", "does_not_fit")]
  if over and over[0][1].over_bytes:
    c, r = over[0]
    return (f"Nothing fits: the closest, {c.label}, needs {r.over_bytes / 2**30:.1f} GiB per device more than "
            f"the {r.hbm_per_device_bytes / 2**30:.1f} GiB of HBM; try more devices"
            + (f", a shorter length, or a remat policy that keeps less ({keeps_less})." if keeps_less else
               " or a shorter length."))
  untried = [(c, r) for c, r in rows if r.status == "missing" and r.model_memory_total and r.hbm_per_device_bytes
             and r.model_memory_total <= r.hbm_per_device_bytes
             and not (r.reason or "").startswith((HOST_OVER, HBM_OVER))]
  if untried:   # e.g. --no-compile without reports for them
    c, r = untried[0]
    return (f"Nothing compiled fits: the first the cost model expects to fit, {c.label} "
            f"({r.model_memory_total / 2**30:.1f} GiB per device), has no compiled step ({r.reason}).")
  expected = [(c, r) for c, r in rows if r.status == "missing" and r.model_memory_total and r.hbm_per_device_bytes
              and r.model_memory_total > r.hbm_per_device_bytes]
  if expected:
    c, r = min(expected, key=lambda cr: cr[1].model_memory_total)
    return (f"Nothing fits: none was worth compiling, and the closest, {c.label}, is expected by the cost model "
            f"to need {(r.model_memory_total - r.hbm_per_device_bytes) / 2**30:.1f} GiB per device "
            f"more than the {r.hbm_per_device_bytes / 2**30:.1f} GiB of HBM; try more devices or a shorter length.")
  host = [(c, r) for c, r in rows if r.status == "missing" and (r.reason or "").startswith(HOST_OVER)]
  if host:   # fits HBM, but its offloaded layer inputs would not fit the host VM's RAM
    c, r = host[0]
    return (f"Nothing fits: {c.label} would fit HBM ({r.model_memory_total / 2**30:.1f} GiB per device), but was "
            f"{r.reason.removeprefix('not compiled: ')}; try one saved input per pair of layers (--remat-group 2), "
            "more devices or a shorter length.")
  return "Nothing fits or nothing was compiled; the reasons are below."
