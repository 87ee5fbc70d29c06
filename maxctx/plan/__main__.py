"""What fits, and what is fastest: the strategy, split of the devices and memory policy to run, measured on the devices
present, or compiled and estimated for a TPU slice (--topology), written as a recipe to train or compile as is.

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
(maxctx.plan.cost_model: memory, collective bytes and a roofline step time from the config alone), then compiled for the
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
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys

from maxctx import config as config_lib
from maxctx import console
from maxctx import mesh as mesh_lib
from maxctx.bench import cases as cases_lib
from maxctx.errors import ArgumentParser, ConfigError, exit_code
from maxctx.plan import tables
from maxctx.plan.candidates import (MLP_CHUNK, REMAT_GROUP, REMATS, candidates, loss_chunk_flag, mlp_chunk_flag,
                                    remat_flag, remat_group_flag)
from maxctx.plan.estimated import estimate_all
from maxctx.plan.measured import RETIME_MAX, RETIME_RATIO, measure_all
from maxctx.plan.ranking import chosen, rank
from maxctx.plan.recipe import recipe

log = logging.getLogger("maxctx.plan")


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
  p.add_argument("--topology", help="plan for this TPU slice (e.g. v5p-128, tpu7x-128) without running: the cost "
                                    "model ranks the candidates and the best are compiled for it until one fits")
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
               tables.verdict(rows) if args.topology else "no candidate ran")
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
    text = tables.markdown_estimated(ranked, setup)
  else:
    import jax
    devices = jax.devices()
    setup = (f"Measured on {n} {devices[0].device_kind} devices ({jax.default_backend()}), 1 warm-up + "
             f"{args.steps} timed steps (median) + 1 profiled step per candidate; those within "
             f"{1 - RETIME_RATIO:.0%} of the fastest (at most {RETIME_MAX}) ran again, in the opposite order, and "
             f"their tokens/s is the median over both rounds (`rounds`). Every candidate trains the same model on the "
             f"same data and global batch. " + config_text)
    text = tables.markdown(ranked, setup)
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
