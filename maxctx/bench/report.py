"""What a benchmark writes to `--out`: results.jsonl (one record per strategy × length), results.md (the tables),
and the same scalars to TensorBoard under `bench/` (the PNG plots are maxctx.bench.plots).

A record (`Record`; every field in the JSON, null where it does not apply) has `strategy`, `seq_len`, `status`
and, unless it ran, `reason`:
  ok        measured on the devices present (tokens_per_s, step_time_s, memory_compiled, peak_bytes_runtime,
            comm_share, comm_share_by_kind, comm_share_all, collective_bytes, loss, ...)
  refused   the strategy cannot run this length on this mesh; `reason` is validate()'s sentence
  failed    it was valid but did not compile or run (e.g. out of memory); `reason` says what the runtime said
  estimate  --topology: compiled, not run; `est_*` fields are roofline estimates (maxctx.bench.roofline); `fits`
            and, when false, `reason` are the compiler's
  does_not_fit  --topology: not compiled, since the shapes alone exceed HBM (all_gather's gathered K/V)
  missing   --topology --no-compile with no cached or matching report
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any, Sequence

from maxctx.bench.cases import tokens
from maxctx.config import MESH_AXES

MIB, GIB = 2**20, 2**30
LOSS_TOLERANCE = 1e-4


@dataclasses.dataclass
class Record:
  """One strategy × length of a benchmark; which fields are filled depends on `status` (see above). Serialised to
  JSON only when written (`to_json`)."""
  strategy: str
  seq_len: int
  length: str
  status: str = "pending"
  reason: str | None = None
  # Both modes: the compiled step.
  mesh: dict[str, int] | None = None
  devices: int | None = None
  device_kind: str | None = None
  flops_per_step: float | None = None
  memory_compiled: dict[str, int] | None = None
  collective_bytes: dict[str, Any] | None = None
  compile_s: float | None = None
  # Measured (status ok): maxctx.bench.measure.
  ulysses_degree: int | None = None
  tokens_per_step: int | None = None
  peak_bytes_runtime: int | None = None
  peak_runtime_note: str | None = None
  step_time_s: float | None = None
  step_times_s: list[float] | None = None
  timed_rounds: int | None = None          # maxctx.plan's re-timed candidates and maxctx.bench --rounds: step_times_s
                                           # pools every round
  tokens_per_s: float | None = None
  loss: float | None = None
  losses: list[float] | None = None
  traced_steps: int | None = None
  traced_s: float | None = None
  comm_s_attention: dict[str, float] | None = None
  comm_s_other: dict[str, float] | None = None
  comm_share: float | None = None
  comm_share_all: float | None = None
  comm_share_by_kind: dict[str, float] | None = None
  profiled_devices: int | None = None
  # Estimated (status estimate): maxctx.bench.aot and the roofline's est_* (maxctx.bench.roofline).
  source: str | None = None
  kernel: str | None = None
  tokens_per_device: int | None = None
  fits: bool | None = None
  over_bytes: int | None = None
  hbm_per_device_bytes: int | None = None
  host_per_host_bytes: int | None = None   # remat full_offload's host memory per host VM of the slice
  host_ram_bytes: int | None = None        # that VM's RAM
  note: str | None = None
  est_compute_s: float | None = None
  est_memory_s: float | None = None
  est_network_s: float | None = None
  est_bytes_per_link: float | None = None
  est_peak_tflops_per_device: float | None = None
  est_bound: str | None = None
  est_step_s: float | None = None
  est_step_s_no_overlap: float | None = None
  est_mfu: float | None = None
  est_tokens_per_s: float | None = None
  est_comm_share: float | None = None
  est_kernel_efficiency: tuple[float, float] | None = None
  est_step_s_range: tuple[float, float] | None = None
  est_mfu_range: tuple[float, float] | None = None
  # The planner's analytic cost model (maxctx.plan.cost_model), before any compile: bytes per device, seconds.
  model_memory: dict[str, float] | None = None
  model_memory_total: float | None = None
  model_host: float | None = None
  model_collective_bytes: dict[str, float] | None = None
  model_step_s: float | None = None
  model_bound: str | None = None
  model_mfu: float | None = None

  def set(self, **fields: Any) -> Record:
    """Fills fields by name; a name the record does not have is a bug, caught here rather than lost in JSON."""
    for name, value in fields.items():
      if name not in _RECORD_FIELDS:
        raise TypeError(f"bench Record has no field {name!r}")
      setattr(self, name, value)
    return self

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


_RECORD_FIELDS = frozenset(f.name for f in dataclasses.fields(Record))


def write_jsonl(records: Sequence[Record], path: pathlib.Path) -> None:
  path.write_text("".join(json.dumps(r.to_json(), sort_keys=True) + "\n" for r in records))


def loss_spread(records: Sequence[Record]) -> dict[int, float]:
  """Length → max − min of the last-step losses of the runs that ran there (each needs two runs to compare)."""
  by_len: dict[int, list[float]] = {}
  for r in records:
    if r.status == "ok":
      by_len.setdefault(r.seq_len, []).append(r.loss)
  return {n: max(v) - min(v) for n, v in by_len.items() if len(v) > 1}


def _kinds(d: dict[str, float] | None, fmt) -> str:
  if not d:
    return "—"
  return ", ".join(f"{k} {fmt(v)}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v)


def _mib(n) -> str:
  return "—" if n is None else f"{n / MIB:,.1f}"


def _memory_cell(r: Record) -> str:
  if r.memory_compiled is None:
    return "does not fit (the compiler ran out of HBM)"
  return f"{r.memory_compiled['total'] / GIB:.1f}" + ("" if r.fits else " (does not fit)")


def _peak(r: Record) -> str:
  if r.peak_runtime_note and "held at once" in r.peak_runtime_note:
    return "not its own (--rounds)"
  return "≤ an earlier run's" if r.peak_runtime_note else _mib(r.peak_bytes_runtime)


def _bytes(n: float) -> str:
  for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
    if n >= size:
      return f"{n / size:,.1f} {unit}"
  return f"{n:.0f} B"


def _mesh(m: dict[str, int] | None) -> str:
  m = m or {}
  return " × ".join(f"{a}={m[a]}" for a in MESH_AXES if m.get(a, 1) > 1) or "1"


def pivot(records: Sequence[Record], field, fmt, status: str) -> list[str]:
  """A Markdown table of one field: strategies down, lengths across; a cell that did not run says why in one word."""
  lengths = sorted({r.seq_len for r in records})
  strategies = list(dict.fromkeys(r.strategy for r in records))
  lines = ["| strategy | " + " | ".join(tokens(n) for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
  for s in strategies:
    cells = []
    for n in lengths:
      r = next((r for r in records if r.strategy == s and r.seq_len == n), None)
      if r is None:
        cells.append("")
      elif r.status != status:
        cells.append(r.status.replace("_", " "))
      else:
        value = field(r)
        cells.append("—" if value is None else fmt(value))
    lines.append(f"| {s} | " + " | ".join(cells) + " |")
  return lines


def markdown_measured(records: Sequence[Record], title: str, setup: str) -> str:
  lines = [f"# {title}", "", setup, "", "Tokens/s (global batch × length / median step time):", "",
           *pivot(records, lambda r: r.tokens_per_s, lambda v: f"{v:,.0f}", "ok"), "",
           "Share of step time in the strategy's collectives (profiler trace):", "",
           *pivot(records, lambda r: r.comm_share, lambda v: f"{100 * v:.1f}%", "ok"), "",
           "Memory per device, MiB (compiled memory_analysis() total):", "",
           *pivot(records, lambda r: r.memory_compiled["total"], _mib, "ok"), "", "All fields:", "",
           "| length | strategy | mesh | tokens/s | step s (median) | memory per device MiB, compiled temp / total | "
           "runtime peak MiB | CP comm share (by kind) | all collectives | CP bytes per device per step | "
           "last loss |", "|---:|---|---|---:|---:|---:|---:|---|---:|---|---:|"]
  for r in records:
    head = f"| {tokens(r.seq_len)} | {r.strategy} |"
    if r.status != "ok":
      lines.append(f"{head} {r.status}: {r.reason} |||||||||")
      continue
    mem = r.memory_compiled
    share = f"{100 * r.comm_share:.1f}%" + (
        f" ({_kinds(r.comm_share_by_kind, lambda v: f'{100 * v:.1f}%')})" if r.comm_share_by_kind else "")
    lines.append(f"{head} {_mesh(r.mesh)} | {r.tokens_per_s:,.0f} | {r.step_time_s:.3f} | "
                 f"{_mib(mem['temp'])} / {_mib(mem['total'])} | {_peak(r)} | {share} | "
                 f"{100 * r.comm_share_all:.1f}% | {_kinds(r.collective_bytes['bytes_attention'], _bytes)} | "
                 f"{r.loss:.6f} |")
  lines += ["", "Last-step loss spread across strategies (max − min; the strategies are exact, so they must agree "
            f"within {LOSS_TOLERANCE:g}):", ""]
  for n, spread in sorted(loss_spread(records).items()):
    lines.append(f"- {tokens(n)}: {spread:.2e} " + ("(agree)" if spread <= LOSS_TOLERANCE else "(**DISAGREE**)"))
  lines += ["", "CP comm share: the mean time one device spends in the attention strategy's collectives (the "
            "`attention` named scope) during the profiled steps, divided by their wall time; \"all collectives\" adds "
            "data-parallel and ZeRO-3 traffic. Bytes are sent per device per step, loop trip counts included "
            "(maxctx/compile/hlo.py). Runtime peak is `device.memory_stats()`, which XLA:CPU does not keep (—); it "
            "counts from the start of the process, so a run below an earlier run's peak cannot be told apart."]
  return "\n".join(lines) + "\n"


def markdown_estimates(records: Sequence[Record], title: str, setup: str, roofline_table: str) -> str:
  lines = [f"# {title}", "", setup, "", "**Every time, throughput and MFU below is an estimate** (roofline from an "
           "ahead-of-time compile; nothing ran). Memory and fit are the compiler's.", "",
           "Memory per device, GiB, compiled (of HBM), and whether it fits:", "",
           *pivot(records, lambda r: r, _memory_cell, "estimate"), "",
           "Estimated tokens/s (estimated MFU), roofline:", "",
           *pivot(records, lambda r: r if r.est_step_s is not None else None,
                  lambda r: f"{r.est_tokens_per_s:,.0f} ({100 * r.est_mfu:.0f}%)" if r.fits
                  else "does not fit", "estimate"), "",
           "Estimated ICI time of all collectives / estimated step time (where compute bounds every strategy, this is "
           "the margin that tells them apart):", "",
           *pivot(records, lambda r: r if r.est_network_s is not None else None,
                  lambda r: f"{100 * r.est_comm_share:.0f}%" + ("" if r.fits else " (does not fit)"),
                  "estimate"), "",
           "All fields:", "",
           "| length | strategy | mesh | tokens/device | memory per device GiB | fits | FLOPs/step | "
           "collective bytes per device | bytes per link | est. compute s | est. HBM s | est. ICI s | "
           "est. step s (bound) | est. tokens/s | est. MFU |", "|---:|---|---|---:|---:|---|---:|---|" + "---:|" * 7]
  skipped = []
  for r in records:
    head = f"| {tokens(r.seq_len)} | {r.strategy} |"
    if r.status != "estimate":
      lines.append(f"{head} {r.status.replace('_', ' ')} |||||||||||||")
      skipped.append(f"- {tokens(r.seq_len)} {r.strategy}: {r.reason}")
      continue
    mem = r.memory_compiled
    total = "—" if mem is None else f"{mem['total'] / GIB:.1f} of {r.hbm_per_device_bytes / GIB:.1f}"
    fits = "yes" if r.fits else "**no**"
    if not r.fits:
      skipped.append(f"- {tokens(r.seq_len)} {r.strategy}: {r.reason}")
    if r.est_step_s is None:
      lines.append(f"{head} {_mesh(r.mesh)} | {r.tokens_per_device:,} | {total} | {fits} | "
                   f"{r.flops_per_step:.2e} | — | — | — | — | — | — | — | — |")
      continue
    coll = r.collective_bytes or {}

    def sec(v):
      return "—" if v is None else f"{v:,.3g}"
    lines.append(f"{head} {_mesh(r.mesh)} | {r.tokens_per_device:,} | {total} | {fits} | "
                 f"{r.flops_per_step:.2e} | {_kinds(all_bytes(coll), _bytes)} | "
                 f"{'—' if r.est_bytes_per_link is None else _bytes(r.est_bytes_per_link)} | "
                 f"{sec(r.est_compute_s)} | {sec(r.est_memory_s)} | {sec(r.est_network_s)} | "
                 f"{sec(r.est_step_s)} ({r.est_bound}) | {r.est_tokens_per_s:,.0f} | "
                 f"{100 * r.est_mfu:.1f}% |")
  if skipped:
    lines += ["", "Refused, not fitting, or not compiled, and why:", "", *skipped]
  for note in sorted({r.note for r in records if r.note}):
    lines += ["", f"Note: {note}."]
  lines += ["", "Roofline inputs (maxctx/bench/roofline.py, with sources):", "", roofline_table, "",
            "Estimate model, per device: compute = analytic FLOPs (× 4/3 under remat full or full_offload, × 5/3 "
            "with model.remat_group > 1) / peak bf16; HBM = (argument + output + 2 × temp bytes) / HBM bandwidth "
            "(a lower bound on traffic); ICI = bytes per link / one link's one-way bandwidth (ring hops use one "
            "link, other collectives all of the chip's links); est. step = the largest of the three (perfect "
            "overlap). MFU = model FLOPs / (est. step × devices × peak). Host transfers of remat full_offload are "
            "not modelled."]
  return "\n".join(lines) + "\n"


def all_bytes(coll: dict | None) -> dict[str, float]:
  """Bytes per kind, both scopes: the TPU compiler rewrites some collectives (all-gathers become all-reduces) without
  the attention scope in their metadata, so on TPU only the sum is trustworthy."""
  sent: dict[str, float] = {}
  for scope in ("bytes_attention", "bytes_other"):
    for k, v in (coll or {}).get(scope, {}).items():
      sent[k] = sent.get(k, 0) + v
  return sent


def tensorboard(records: Sequence[Record], logdir: pathlib.Path, prefix: str = "bench") -> None:
  """Scalars `bench/<strategy>/<field>` at step = sequence length, so TensorBoard draws each field against length."""
  from maxctx import metrics as metrics_lib
  fields = ("tokens_per_s", "step_time_s", "comm_share", "comm_share_all", "loss", "peak_bytes_runtime",
            "est_tokens_per_s", "est_step_s", "est_mfu", "est_comm_share")
  writer = metrics_lib.Writer(logdir, 0)
  try:
    for r in records:
      values = {f"{prefix}/{r.strategy}/{f}": float(getattr(r, f)) for f in fields
                if isinstance(getattr(r, f), (int, float)) and math.isfinite(getattr(r, f))}
      if r.memory_compiled:
        values[f"{prefix}/{r.strategy}/memory_compiled_bytes"] = float(r.memory_compiled["total"])
      writer.scalars(r.seq_len, values)
  finally:
    writer.close()

