"""`--topology`: nothing runs; each (strategy, length) is compiled ahead of time for a TPU slice with
`maxctx.compile.step.compile_for`, and its memory, fit and collective bytes feed a roofline estimate
(maxctx.bench.roofline).

An 8B step for 128 devices takes minutes to tens of minutes to compile on a small machine, so reports are reused:
  1. the cache under `<out>/compile-cache/`, keyed by a hash of what decides the compiled step (model, mesh,
     attention, optimizer, sequence length, batch; see `program_fields`), the topology and the slice count;
  2. `--reports DIR`: JSON reports written by `python -m maxctx.compile --json` or `scripts/compile_recipes.py`
     (e.g. runs/compile/), used when every field the report records (topology, strategy, kernel, length, batch, mesh,
     remat and its layer group, loss chunk, blocks, parameter count) agrees with the run's config. Such reports carry
     no collective bytes, so their network time is left out of the estimate, and it says so;
  3. otherwise a compile (unless `--no-compile`), whose report is cached; except that an all_gather whose
     whole-sequence K, V, dK and dV of one layer alone exceed HBM is reported as not fitting from the shapes, without
     a compile (at 14M tokens that compile would take long to say the same).
"""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib
from typing import Any

from maxctx import attention
from maxctx import chips as chips_lib
from maxctx import metrics as metrics_lib
from maxctx import topology as topology_lib
from maxctx import trainer as trainer_lib
from maxctx.bench import roofline
from maxctx.bench.cases import Case
from maxctx.compile import hlo as hlo_lib
from maxctx.compile import step as compile_step
from maxctx.compile.report import CompileReport
from maxctx.config import Config
from maxctx.errors import MaxctxError

log = logging.getLogger("maxctx.bench")

CACHE_VERSION = 2
# Fields a maxctx.compile report records about the config; a report from --reports is used only if all agree.
_MATCHED = ("topology", "num_slices", "strategy", "kernel", "seq_len", "batch_size", "mesh", "remat", "loss_chunk",
            "mlp_chunk", "block_q", "block_kv", "params")


def program_fields(config: Config) -> dict[str, Any]:
  """What decides the compiled step: the step is lowered on abstract batches, so data sources, paths, run names and
  logging do not enter it, and a cache keyed on them would go stale whenever an unrelated key is added."""
  tree = config.to_dict()
  return {"model": tree["model"], "mesh": tree["mesh"], "attention": tree["attention"], "optim": tree["optim"],
          "seq_len": config.data.seq_len, "batch_size": config.data.batch_size, "on_nan": config.run.on_nan}


def config_key(config: Config, topology: str, num_slices: int) -> str:
  text = json.dumps([CACHE_VERSION, program_fields(config), topology, num_slices], sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _expected(config: Config, topo: topology_lib.Topology, num_slices: int, mesh: dict[str, int]) -> dict[str, Any]:
  a = config.attention
  return {"topology": topo.name, "num_slices": num_slices, "strategy": a.strategy, "kernel": a.kernel,
          "seq_len": config.data.seq_len, "batch_size": config.data.batch_size, "mesh": mesh,
          "remat": config.model.remat, "loss_chunk": config.model.loss_chunk, "mlp_chunk": config.model.mlp_chunk,
          "block_q": a.block_q, "block_kv": a.block_kv, "params": metrics_lib.param_count(config.model)}


def find_report(directory: pathlib.Path, config: Config, topo: topology_lib.Topology, num_slices: int,
                mesh: dict[str, int]) -> tuple[CompileReport, pathlib.Path] | None:
  """A compile report in `directory` whose recorded fields all match `config` on `topo`."""
  if config.attention.ulysses_degree is not None:
    return None  # reports do not record it, so a match could not be told from a mismatch
  want = _expected(config, topo, num_slices, mesh)
  for path in sorted(directory.glob("*.json")):
    try:
      report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
      continue
    # A report from before model.mlp_chunk existed was compiled without chunking (and one from before
    # model.remat_group without layer groups: CompileReport.remat_group).
    if isinstance(report, dict) and all(report.get(k, 0 if k == "mlp_chunk" else None) == v
                                        for k, v in want.items()):
      parsed = CompileReport.from_json(report)
      if parsed.remat_group == config.model.remat_group:
        return parsed, path
  return None


def held_kv_bytes(config: Config, mesh: dict[str, int]) -> int:
  """Per-device bytes of K/V and their gradients that the strategy holds at once in one layer's backward, from the
  shapes (see `Strategy.held_kv_bytes`), at no more than the compute dtype. More than HBM cannot fit, compiled or
  not."""
  m, d = config.model, config.data
  rows = max(d.batch_size // (mesh["data"] * mesh["fsdp"] * config.optim.grad_accum), 1)
  dtype_bytes = 2 if m.dtype == "bfloat16" else 4
  problem = trainer_lib.attention_problem(config, mesh, platform="tpu")
  return attention.get(config.attention.strategy).held_kv_bytes(problem, rows, m.head_dim, dtype_bytes)


def _inspect(compiled) -> dict[str, Any]:
  text = compiled.as_text()
  return {"collective_bytes": hlo_lib.collectives(text, hlo_lib.num_partitions(text, 1)).summary()}


def report_for(case: Case, mesh: dict[str, int], out_dir: pathlib.Path, reports: list[pathlib.Path],
               compile_missing: bool) -> tuple[CompileReport | None, str]:
  """(the compile report of `case` for its config's compile.topology, where it came from); (None, why) when there is
  none and none may be made."""
  topo = topology_lib.resolve(case.config.compile.topology)
  num_slices = case.config.compile.num_slices
  key = config_key(case.config, topo.name, num_slices)
  cache = out_dir / "compile-cache" / f"{case.name}-{topo.name}-{key}.json"
  if cache.exists():
    return CompileReport.from_json(json.loads(cache.read_text())), f"cache {cache.name}"
  for directory in reports:
    if found := find_report(directory, case.config, topo, num_slices, mesh):
      return found[0], f"report {found[1]}"
  if mesh["context"] > 1 and (need := held_kv_bytes(case.config, mesh)) > topo.hbm_bytes:
    return None, (f"does not fit (from the shapes, not compiled): in each layer's backward "
                  f"{case.config.attention.strategy} holds K, V, dK and dV of at least "
                  f"{need / topology_lib.GIB:.1f} GiB per device of {topo.hbm_bytes / topology_lib.GIB:.1f} GiB HBM "
                  "before anything else")
  if not compile_missing:
    return None, "not compiled (no cached or matching report; run without --no-compile)"
  log.info("compiling %s for %s ...", case.name, topo.name)
  report = compile_step.compile_for(case.config, inspect=_inspect)
  cache.parent.mkdir(parents=True, exist_ok=True)
  cache.write_text(json.dumps({**report.to_json(), "config_key": key, "program_fields": program_fields(case.config)},
                              indent=2))
  return report, f"compiled in {report.compile_seconds:.0f} s"


def record(case: Case, mesh: dict[str, int], out_dir: pathlib.Path, reports: list[pathlib.Path],
           compile_missing: bool) -> dict[str, Any]:
  """The estimate record of one case: the compile report's memory and fit, the roofline, and where it came from."""
  topo = topology_lib.resolve(case.config.compile.topology)
  try:
    report, source = report_for(case, mesh, out_dir, reports, compile_missing)
  except MaxctxError as e:
    return {"status": "failed", "reason": str(e)}
  if report is None:
    return {"status": "does_not_fit" if source.startswith("does not fit") else "missing", "reason": source}
  memory = report.to_json()["memory"]
  rec: dict[str, Any] = {"status": "estimate", "source": source, "mesh": report.mesh, "devices": report.devices,
                         "device_kind": report.device_kind, "tokens_per_device": report.tokens_per_device,
                         "flops_per_step": report.flops_per_step, "fits": report.fits,
                         "over_bytes": report.over_bytes, "hbm_per_device_bytes": report.hbm_per_device_bytes,
                         "memory_compiled": memory, "collective_bytes": report.inspected.get("collective_bytes"),
                         "compile_s": report.compile_seconds, "kernel": report.kernel,
                         "host_per_host_bytes": report.host_bytes_per_host if report.devices_per_host else None,
                         "host_ram_bytes": report.host_ram_bytes}
  if report.memory is None:
    needed = report.required_bytes
    bound = "at least " if report.required_is_lower_bound else ""
    rec["reason"] = ("does not fit: the compiler ran out of HBM" + (
        f", needing {bound}{needed / topology_lib.GIB:.1f} GiB of {topo.hbm_bytes / topology_lib.GIB:.1f} GiB"
        if needed else "") + f" ({(report.error or '')[:160]})")
    return rec
  if not report.host_fits:
    rec["reason"] = (f"does not fit: remat full_offload keeps {report.host_bytes_per_host / topology_lib.GIB:.1f} GiB "
                     f"in each host VM's memory, more than {chips_lib.HOST_MEMORY_SHARE:.0%} of its "
                     f"{report.host_ram_bytes / topology_lib.GIB:.1f} GiB RAM")
  elif not report.fits:
    rec["reason"] = (f"does not fit: needs {report.memory.total / topology_lib.GIB:.1f} GiB per device of "
                     f"{topo.hbm_bytes / topology_lib.GIB:.1f} GiB HBM ({report.over_bytes / topology_lib.GIB:.1f} "
                     "GiB over)")
  rec.update(roofline.estimate(report, topo, roofline.recomputed_flops(case.config, mesh)))
  coll = rec.get("collective_bytes")
  if coll is None:
    rec["note"] = "network time not estimated: the report has no collective bytes (compile it with maxctx.bench)"
  elif coll.get("unknown_trip_counts"):
    # The ring's pass loop has a bound XLA must not see (maxctx.attention.ring, `passes`), and the TPU compiler's
    # HLO states no trip counts: its collectives are counted once, not once per pass.
    rec["note"] = ("collective bytes and network time are lower bounds: some collectives sit in loops whose trip "
                   "count the compiled HLO does not state, and are counted once per step")
  return rec
