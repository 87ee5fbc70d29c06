"""Which strategy, which split of the devices, which memory policy: a plan measured on the devices present, or
compiled and estimated for a TPU slice.

    python -m maxctx.plan configs/bench.yml [section.key=value ...] [--lengths 512,1k] [--remat none,full]
        [--remat-group 1,2] [--mlp-chunk 0,16384] [--loss-chunk 1024,2048]
        [--strategies none,all_gather,ulysses,ring,usp] [--steps 3] [--out DIR]
        [--topology v5p-128 [--num-slices N] [--compile N] [--reports DIR] [--no-compile]]

Candidates, for each length: every strategy at every context degree that divides the devices left by the run's data
and tensor axes (the rest on fsdp), usp at every ulysses degree between 1 and its context degree, `none` (no context
parallelism, context 1), each under every remat policy of `--remat` (default: the run's; `auto`: all; `full` and
`full_offload` also in every layer group of `--remat-group`, default the run's model.remat_group, and 1 and 2 with
--topology, where a length may fit only saving one input per pair of layers) and with every
MLP chunk of `--mlp-chunk` (default: the run's model.mlp_chunk and 16,384 tokens; a chunk that does not split the
candidate's tokens per device is the unchunked MLP, tried once), and, with `--loss-chunk`, with every model.loss_chunk
given (tokens per device per step of the loss's logits; default: the run's only). `maxctx.trainer.validate` checks
each; what it refuses is listed with its sentence.

Measured mode (no --topology): each valid candidate trains a few steps on the devices present
(`maxctx.bench.measure`: the same model, data and global batch every time, so the candidates differ only in how they
are split). The (at most 3) candidates within 15% of the fastest are trained again, in the opposite order, and the plan
for a length is the candidate with the most tokens/s over all its timed steps.

Topology mode (--topology): nothing runs. Every valid candidate is first estimated by the analytic cost model
(maxctx.plan_model: memory, collective bytes and a roofline step time from the config alone), then compiled for the
slice in the model's order -- least estimated step time among those it expects to fit, then least memory --
`--compile N` of them (default 2), and more only until one fits; candidates expected over 1.25 × HBM, or to fill
more than maxctx.train's share of a host VM's RAM with offloaded layer inputs (an exact count), are not compiled
(`--compile 0` compiles every candidate). Compiles are cached under --out, or reused from --reports. A compiled
candidate is estimated with maxctx.bench's roofline from its compiled memory and collectives; the plan is the compiled
candidate that fits with the least such estimated step time (ties, common when every candidate is compute-bound, go to
the one needing less memory). When nothing fits, the plan says which candidate came closest and by how many GiB.
plan.md lists the model's estimate beside the compiler's for every candidate.

Writes to --out (default <run.output_dir>/plan, or plan-<topology>): plan.md (every candidate, ranked), plan.jsonl (one
record each) and recipe.yml -- the run file with the chosen strategy, mesh, remat and MLP chunk, which `maxctx.train`
and `maxctx.compile` take as is (with several lengths, recipe-<length>.yml for each; in topology mode its
compile.topology is the slice). Timings on fake CPU devices share the host's cores: they rank the candidates' overheads
on this machine, not accelerator speed.

maxctx.plan_candidates lists the candidates; maxctx.plan_tables writes plan.md; maxctx.plan_auto resolves
`attention.strategy: auto` and `model.remat: auto` in a run file with either mode: measured for `maxctx.train`, for
the slice for `maxctx.compile`.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import statistics
import sys

import yaml

from maxctx import chips as chips_lib
from maxctx import config as config_lib
from maxctx import console
from maxctx import mesh as mesh_lib
from maxctx import plan_tables
from maxctx.bench import plan as cases_lib
from maxctx.bench import report
from maxctx.config import Config
from maxctx.errors import ArgumentParser, ConfigError, exit_code
from maxctx.plan_candidates import (MLP_CHUNK, REMAT_GROUP, REMATS, Candidate, candidates, loss_chunk_flag,
                                    mlp_chunk_flag, remat_flag, remat_group_flag)
from maxctx.plan_tables import chosen

log = logging.getLogger("maxctx.plan")


def _record(cand: Candidate) -> report.Record:
  rec = report.Record(strategy=cand.strategy, seq_len=cand.case.seq_len, length=cases_lib.tokens(cand.case.seq_len))
  if cand.case.refused:
    rec.set(status="refused", reason=cand.case.refused)
  return rec


# Measured candidates with at least this share of the fastest's tokens/s (within issue 18's 15%) are timed a second
# time before one is chosen: on the 2-core CPU host the same candidate was seen 22% apart in two processes (README,
# "Choosing a strategy"), so a first-round lead that small is no evidence. At most RETIME_MAX of them, to bound the
# time a plan takes.
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
    rec = _record(cand)
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


# A candidate expected this far over HBM is not compiled: on the compiled steps the model was checked against
# (README) it was at most 2% over the compiler's total.
NOT_WORTH_COMPILING = 1.25


def estimate_all(cands: list[Candidate], n: int, slices: int, out: pathlib.Path, reports: list[pathlib.Path],
                 compile_missing: bool, budget: int) -> list[report.Record]:
  """Estimates every valid candidate with the cost model (maxctx.plan_model), then takes them in its order -- least
  estimated step time among those expected to fit, then least memory -- and compiles each for the topology in its
  config: `budget` compiles, past that only until one fits (0: every candidate). The memory expected of a candidate is
  the model's, scaled by the largest compiled / modelled ratio seen so far under its remat policy and layer group (the
  model errs most in what a policy saves), so one compile that does not fit spares its siblings. A candidate whose
  offloaded layer inputs would fill more than HOST_MEMORY_SHARE of a host VM's RAM is not compiled (the model's host
  bytes are the compiler's). Reports are cached under `out` or taken from `reports`; a candidate with one is estimated
  by maxctx.bench's roofline from it. Logs each."""
  from maxctx import plan_model
  from maxctx import topology as topology_lib
  from maxctx.bench import aot
  valid = [c for c in cands if c.case.config is not None]
  topo = topology_lib.resolve(valid[0].case.config.compile.topology) if valid else None
  sizes = {c: mesh_lib.axis_sizes(c.case.config.mesh, n, slices) for c in valid}
  model = {c: plan_model.estimate(c.case.config, sizes[c], topo) for c in valid}
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
    rec = _record(cand).set(mesh=sizes[cand], hbm_per_device_bytes=hbm, **est.fields())
    rec.set(**aot.record(cand.case, sizes[cand], out, reports, may_compile))
    compiled += (rec.source or "").startswith("compiled")
    fitting += chosen(rec)
    if rec.memory_compiled:
      ratio[cand.policy] = max(ratio.get(cand.policy, 0.0), rec.memory_compiled["total"] / est.total)
    if rec.status == "missing" and compile_missing and budget and want > NOT_WORTH_COMPILING * hbm:
      scaled = (f" (the cost model's {est.total / 2**30:.1f} × {ratio[cand.policy]:.2f}, as compiled under "
                f"{cand.remat_label})" if cand.policy in ratio else "")
      rec.set(reason=f"{plan_tables.HBM_OVER} {want / 2**30:.1f} GiB per device of {hbm / 2**30:.1f} GiB "
                     f"HBM{scaled}")
    elif rec.status == "missing" and compile_missing and budget and host_over(cand):
      rec.set(reason=f"{plan_tables.HOST_OVER} {est.host * per_host / 2**30:.1f} GiB of saved layer inputs "
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
  rows = [(c, measured.get(c) or _record(c)) for c in cands]
  return sorted(rows, key=lambda cr: _order(cr[1]))


def recipe(path: str, cand: Candidate, overrides: list[str]) -> str:
  """The run file at `path` with the command line's overrides and the candidate's keys set: what was measured, or
  compiled for the topology in the candidate's compile section."""
  tree = yaml.safe_load(pathlib.Path(path).read_text()) or {}
  if isinstance(tree.get("model"), str):
    tree["model"] = {"preset": tree["model"]}
  keys = dict(config_lib.parse_override(o) for o in overrides)
  keys.update(cand.overrides)
  keys["data.seq_len"] = cand.case.seq_len
  config = cand.case.config
  topology = config.compile.topology
  if topology:
    keys.update({"compile.topology": topology, "compile.num_slices": config.compile.num_slices})
    if "run.name" not in keys and config.model.preset:
      # A recipe for a slice is named as configs/recipes/ names them, not after the run file it was planned from
      # (a 70B plan from the 8B recipe would otherwise be called llama3.1-8b-... and write to its runs/).
      name = f"{config.model.preset}-{cases_lib.tokens(cand.case.seq_len)}-{cand.case.strategy}-{topology}"
      keys.update({"run.name": name, "run.output_dir": f"runs/{name}"})
  for dotted, value in keys.items():
    node = tree
    *parents, leaf = dotted.split(".")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  why = (f"had the least estimated step time of those that fit on {topology} (compiled)" if topology else
         "was the fastest measured candidate")
  head = (f"# Planned by python -m maxctx.plan {path}: {cand.label} at {cand.case.seq_len} tokens {why} (see plan.md "
          "beside this file).\n")
  return head + yaml.safe_dump(tree, sort_keys=False)


def _parser() -> argparse.ArgumentParser:
  p = ArgumentParser(prog="python -m maxctx.plan", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("config", help="the run's YAML file: model, mesh (data and tensor axes are kept), data, batch")
  p.add_argument("overrides", nargs="*", help="section.key=value applied to every candidate")
  p.add_argument("--strategies", default=cases_lib.DEFAULT_STRATEGIES,
                 help=f"comma-separated; `none` = no context parallelism (default {cases_lib.DEFAULT_STRATEGIES})")
  p.add_argument("--lengths", help="comma-separated tokens per sequence, k = 2^10, m = 2^20 (default: data.seq_len)")
  p.add_argument("--remat", help=f"comma-separated remat policies to try, of {', '.join(REMATS)}, or auto for all "
                                 "of them (default: the run's model.remat)")
  p.add_argument("--remat-group", help=f"comma-separated model.remat_group values to try under remat full and "
                                       f"full_offload, layers per saved input (default: the run's; with --topology "
                                       f"also 1 and {REMAT_GROUP})")
  p.add_argument("--mlp-chunk", help=f"comma-separated model.mlp_chunk values to try, tokens per MLP step, 0 for "
                                     f"all at once (default: the run's and {MLP_CHUNK}); one that does not split a "
                                     "candidate's tokens per device is the same as 0")
  p.add_argument("--loss-chunk", help="comma-separated model.loss_chunk values to try, tokens per device per step of "
                                      "the loss's logits (default: the run's only)")
  p.add_argument("--steps", type=int, default=3, help="timed steps per candidate after one warm-up (default 3)")
  p.add_argument("--out", help="output directory (default <run.output_dir>/plan, or plan-<topology> with --topology)")
  p.add_argument("--topology", help="plan for this TPU slice (e.g. v5p-128, tpu7x-128) without running: each "
                                    "candidate is compiled for it and estimated, as maxctx.bench --topology does")
  p.add_argument("--num-slices", type=int, default=1, help="with --topology: slices over DCN (default 1)")
  p.add_argument("--reports", action="append", default=[],
                 help="with --topology: a directory of maxctx.compile --json reports to reuse (repeatable)")
  p.add_argument("--compile", type=int, default=2, metavar="N",
                 help="with --topology: compile the N candidates the cost model ranks best, and more only until one "
                      "fits (default 2; 0 compiles every candidate)")
  p.add_argument("--no-compile", action="store_true",
                 help="with --topology: use cached or given reports only, compile nothing")
  return p


def run(args: argparse.Namespace) -> int:
  config = config_lib.load(args.config, args.overrides)
  strategies = cases_lib.parse_strategies(args.strategies)
  lengths = cases_lib.lengths(args.lengths) if args.lengths else [config.data.seq_len]
  remats = remat_flag(args.remat, config)
  chunks = mlp_chunk_flag(args.mlp_chunk, config)
  groups = remat_group_flag(args.remat_group, config, bool(args.topology))
  loss_chunks = loss_chunk_flag(args.loss_chunk)
  if args.steps < 1:
    raise ConfigError(f"--steps is {args.steps}; time at least one step per candidate.")
  if args.compile < 0:
    raise ConfigError(f"--compile is {args.compile}; give how many candidates to compile, or 0 for all of them.")
  if args.topology:   # every candidate is compiled for it (maxctx.compile reads the config's compile section)
    from maxctx import topology as topology_lib
    from maxctx.bench import roofline
    topo = topology_lib.resolve(args.topology)
    roofline.chip_for(topo)   # a chip without roofline figures stops here, before any compile
    if args.num_slices < 1:
      raise ConfigError(f"--num-slices is {args.num_slices}; plan for at least one slice.")
    config = config.replace(**{"compile.topology": args.topology, "compile.num_slices": args.num_slices})
    n, slices, platform, steps = topo.devices * args.num_slices, args.num_slices, "tpu", None
    where = f"{n} devices of {topo.name}" + (f" × {slices} slices" if slices > 1 else "")
  else:
    import jax
    n, slices, platform, steps = len(jax.devices()), mesh_lib.num_slices_of(jax.devices()), None, args.steps + 2
    where = f"{n} {jax.default_backend().upper()} devices"
  by_length = {s: candidates(config, strategies, s, remats, n, slices, steps=steps, platform=platform,
                             chunks=chunks, loss_chunks=loss_chunks, groups=groups)
               for s in lengths}
  valid = sum(c.case.config is not None for cs in by_length.values() for c in cs)
  if not valid:
    first = next(c for cs in by_length.values() for c in cs)
    raise ConfigError(f"no candidate can run: e.g. {first.label}: {first.case.refused}")
  out = pathlib.Path(args.out or f"{config.run.output_dir}/plan" + (f"-{args.topology}" if args.topology else ""))
  out.mkdir(parents=True, exist_ok=True)  # only now: a refused command leaves nothing behind
  log.info("%d candidates to %s (%d refused) for %s, into %s", valid,
           "estimate and compile" if args.topology else "measure",
           sum(len(cs) for cs in by_length.values()) - valid, where, out)
  ranked, records = {}, []
  for seq_len, cands in by_length.items():
    found = (estimate_all(cands, n, slices, out, [pathlib.Path(d) for d in args.reports], not args.no_compile,
                          args.compile)
             if args.topology else measure_all(cands, args.steps))
    ranked[seq_len] = rank(cands, found)
    records += [{"candidate": c.label, "context": c.context, "ulysses": c.ulysses, "remat": c.remat,
                 "remat_group": c.remat_group, "mlp_chunk": c.mlp_chunk,
                 "loss_chunk": c.case.config.model.loss_chunk if c.case.config else None,
                 "rank": i if chosen(r) else None, **r.to_json()}
                for i, (c, r) in enumerate(ranked[seq_len], 1)]
  written = []
  for seq_len, rows in ranked.items():
    if not chosen(rows[0][1]):
      log.info("%s tokens: no recipe: %s", cases_lib.tokens(seq_len),
               plan_tables.verdict(rows) if args.topology else "no candidate ran")
      continue
    name = "recipe.yml" if len(lengths) == 1 else f"recipe-{cases_lib.tokens(seq_len)}.yml"
    (out / name).write_text(recipe(args.config, rows[0][0], args.overrides))
    written.append(name)
    best = rows[0][1]
    log.info("%s tokens: %s (%s)", cases_lib.tokens(seq_len), rows[0][0].label,
             f"est. step {best.est_step_s:.3g} s" if args.topology else f"{best.tokens_per_s:,.0f} tokens/s")
  config_text = f"Config {args.config}" + (f" with {' '.join(args.overrides)}" if args.overrides else "") + "."
  if args.topology:
    setup = (f"Compiled ahead of time for {where} ({topo.generation.device_kind}, {topo.hbm_bytes / 2**30:.2f} GiB "
             "HBM per device); memory is the compiler's. Ranked by maxctx.bench's roofline estimate of the step "
             "(`est.`): the time the step's FLOPs, HBM bytes and collective bytes need at the chip's peak rates, with "
             "the overlap rule maxctx.bench states; a lower bound on step time that ranks candidates by the work "
             "they must do, not by the speed our kernels reach. Candidates that tie there are ranked by memory. "
             + config_text)
    text = plan_tables.markdown_estimated(ranked, setup)
  else:
    import jax
    devices = jax.devices()
    setup = (f"Measured on {n} {devices[0].device_kind} devices ({jax.default_backend()}), 1 warm-up + "
             f"{args.steps} timed steps (median) + 1 profiled step per candidate; those within "
             f"{1 - RETIME_RATIO:.0%} of the fastest (at most {RETIME_MAX}) ran again, in the opposite order, and "
             f"their tokens/s is the median over both rounds (`rounds`). Every candidate trains the same model on the "
             f"same data and global batch. " + config_text)
    text = plan_tables.markdown(ranked, setup)
  (out / "plan.md").write_text(text)
  (out / "plan.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
  print(text)
  log.info("wrote %s: plan.md, plan.jsonl, %s", out, ", ".join(written) or "no recipe")
  return 0 if written else 1


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
  console.setup("stderr")
  logging.getLogger("maxctx.data").setLevel(logging.WARNING)
  return exit_code(lambda: run(args))


if __name__ == "__main__":
  sys.exit(main())
