"""How do the context-parallel strategies compare, length by length? Tokens/s, peak memory and communication share
per strategy and sequence length, as tables and plots (to choose what to run, use maxctx.plan).

    python -m maxctx.bench configs/bench.yml [section.key=value ...] [--strategies none,all_gather,ulysses,ring,usp]
        [--lengths 256,512,1k,2k] [--steps 3] [--rounds 1] [--context 4] [--also RUN_FILE]... [--out DIR]
    python -m maxctx.bench configs/recipes/llama3.1-8b-14m-ring-tpu7x-128.yml --topology tpu7x-128 \\
        --lengths 1m,4m,14m [--reports runs/compile] [--no-compile] [--out DIR]

Without --topology it trains each strategy × length for a few steps on the devices present (the same model, data and
global batch every time) and measures; with --topology nothing runs: each configuration is compiled for that TPU slice
and estimated (maxctx.bench.aot, maxctx.bench.roofline). Each strategy runs on the config's mesh and memory policy:
the sweep compares strategies, where `python -m maxctx.plan` also searches splits and policies and writes the one to
run. Writes results.jsonl, results.md, tokens_per_s.png, memory.png, comm_share.png and tensorboard/ (scalars under
bench/) to --out (default <run.output_dir>/bench[-TOPOLOGY]).
--also adds a run file (with the command's overrides) as it stands, its strategy, mesh and memory policy at its own
data.seq_len, beside the sweep's cases of that length, e.g. a recipe from maxctx.plan; with --rounds it is timed in
the same turns as they are. It should train the sweep's model on its data (the float32 loss check compares them).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import pathlib
import sys

from maxctx import config as config_lib
from maxctx import console
from maxctx import metrics as metrics_lib
from maxctx.bench import cases as cases_lib
from maxctx.bench import plots, report
from maxctx.errors import ArgumentParser, ConfigError, exit_code

log = logging.getLogger("maxctx.bench")

DEFAULT_LENGTHS = "256,512,1k,2k"   # what 5 strategies finish in ~10 minutes with the tiny model on 2 CPU cores
DEFAULT_TOPOLOGY_LENGTHS = "1m,4m,14m"


def _parser() -> argparse.ArgumentParser:
  p = ArgumentParser(prog="python -m maxctx.bench", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("config", help="the run's YAML file: model, mesh, data, batch (e.g. configs/bench.yml)")
  p.add_argument("overrides", nargs="*", help="section.key=value applied to every run, e.g. data.batch_size=16")
  p.add_argument("--strategies", default=cases_lib.DEFAULT_STRATEGIES,
                 help=f"comma-separated; `none` = no context parallelism (default {cases_lib.DEFAULT_STRATEGIES})")
  p.add_argument("--lengths", help=f"comma-separated tokens per sequence, k = 2^10, m = 2^20 (default "
                                   f"{DEFAULT_LENGTHS}; with --topology {DEFAULT_TOPOLOGY_LENGTHS})")
  p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step (default 3)")
  p.add_argument("--rounds", type=int, default=1,
                 help="time each length's runs in this many turns of --steps steps, every other turn in the opposite "
                      "order, all of that length's runs held at once: steadier ranks where the host's speed drifts "
                      "(fake CPU devices); default 1, each run whole before the next")
  p.add_argument("--also", action="append", default=[], metavar="RUN_FILE",
                 help="also run this run file as it stands, at its own data.seq_len (repeat the flag for each file)")
  p.add_argument("--trace-steps", type=int, default=1, help="profiled steps after the timed ones (default 1)")
  p.add_argument("--context", type=int, help="context degree of the CP strategies (default: the config's)")
  p.add_argument("--out", help="output directory (default <run.output_dir>/bench, or bench-<topology>)")
  p.add_argument("--topology", help="compile for this TPU slice (e.g. tpu7x-128) and estimate instead of running")
  p.add_argument("--num-slices", type=int, default=1, help="--topology: slices (default 1)")
  p.add_argument("--reports", action="append", default=[],
                 help="--topology: a directory of maxctx.compile JSON reports to reuse (repeatable)")
  p.add_argument("--no-compile", action="store_true",
                 help="--topology: use cached and --reports reports only; never compile")
  return p


def _setup_logging() -> None:
  console.setup("stderr")
  logging.getLogger("maxctx.data").setLevel(logging.WARNING)


def _base_record(case: cases_lib.Case) -> report.Record:
  rec = report.Record(strategy=case.strategy, seq_len=case.seq_len, length=cases_lib.tokens(case.seq_len))
  if case.refused:
    rec.set(status="refused", reason=case.refused)
  return rec


def _model_line(config: config_lib.Config) -> str:
  m, d = config.model, config.data
  return (f"model {m.preset or 'custom'} ({metrics_lib.param_count(m) / 1e6:,.1f}M parameters, {m.dtype}), "
          f"global batch {d.batch_size}, data {d.source}, kernel {config.attention.kernel}, "
          f"load_balance {str(config.attention.load_balance).lower()}")


def _by_length(cases: list[cases_lib.Case]) -> list[list[int]]:
  """The indices of each length's cases, for cases already `in_length_order`."""
  return [[i for i, _ in group] for _, group in itertools.groupby(enumerate(cases), key=lambda p: p[1].seq_len)]


def _timed(args: argparse.Namespace) -> str:
  if args.rounds == 1:
    return str(args.steps)
  return (f"{args.rounds} × {args.steps} (each length's runs held at once and timed in {args.rounds} turns, every "
          "other turn in the opposite order)")


def also_cases(args: argparse.Namespace, n: int, slices: int, steps: int, platform: str | None) -> list[cases_lib.Case]:
  """The --also run files as cases: each as it stands, at its own length, named `<strategy>_<file stem>` (`none` runs
  as all_gather on a context of one, so its recipe shows as all_gather)."""
  cases = []
  for path in args.also:
    config = config_lib.load(path, args.overrides)
    if args.topology:
      config = config.replace(**{"compile.topology": args.topology, "compile.num_slices": args.num_slices})
    strategy = config.attention.strategy
    if strategy == "auto":
      raise ConfigError(f"--also {path} has attention.strategy auto, which is a plan, not a run; plan it with "
                        "python -m maxctx.plan and pass the recipe.yml it writes.")
    name = f"{strategy}_{pathlib.Path(path).stem}"
    if name in (c.strategy for c in cases):
      raise ConfigError(f"--also {path} would be named {name} like an earlier --also file; rename one of them.")
    case = cases_lib.configure(config, strategy, config.data.seq_len, n, slices, None, steps, platform)
    cases.append(dataclasses.replace(case, strategy=name))
  return cases


def in_length_order(cases: list[cases_lib.Case]) -> list[cases_lib.Case]:
  """The cases by sequence length, in the order the lengths first appear, each length's in their own order: an --also
  file runs beside the sweep's cases of its length."""
  first: dict[int, int] = {}
  for case in cases:
    first.setdefault(case.seq_len, len(first))
  return sorted(cases, key=lambda c: first[c.seq_len])


def measure_all(config, cases, args) -> tuple[list[report.Record], str, str]:
  import jax
  from maxctx.bench import measure
  steps = measure.Steps(warmup=1, timed=args.steps, traced=args.trace_steps)
  records = [_base_record(case) for case in cases]
  # One case at a time, or with --rounds each length's cases together; logged when its case, or its length, is done.
  for group in ([[i] for i in range(len(cases))] if args.rounds == 1 else _by_length(cases)):
    runnable = [i for i in group if cases[i].config is not None]
    for i, result in zip(runnable, measure.attempt_all([cases[i] for i in runnable], steps, args.rounds)):
      records[i].set(**result)
    for i in group:
      case, rec = cases[i], records[i]
      if rec.status == "ok":
        log.info("[%d/%d] %s %s: %s tokens/s, step %.3f s, CP comm %.1f%%, loss %.6f", i + 1, len(cases),
                 case.strategy, rec.length, f"{rec.tokens_per_s:,.0f}", rec.step_time_s, 100 * rec.comm_share,
                 rec.loss)
      else:
        log.info("[%d/%d] %s %s: %s: %s", i + 1, len(cases), case.strategy, rec.length, rec.status, rec.reason)
  devices = jax.devices()
  where = f"{config.model.preset or 'model'}, {len(devices)} {devices[0].platform.upper()} devices"
  setup = (f"Measured on {len(devices)} {devices[0].device_kind} devices ({jax.default_backend()}); "
           f"{_model_line(config)}; 1 warm-up + {_timed(args)} timed steps (median) + {args.trace_steps} profiled.")
  if jax.default_backend() == "cpu":
    setup += (" Fake CPU devices share the host's cores, so this ranks the strategies' overheads, not accelerator "
              "speed.")
  return records, where, setup


def estimate_all(config, cases, args, out: pathlib.Path) -> tuple[list[report.Record], str, str]:
  from maxctx import mesh as mesh_lib
  from maxctx import topology as topology_lib
  from maxctx.bench import aot
  topo = topology_lib.resolve(args.topology)
  n = topo.devices * args.num_slices
  records = []
  for i, case in enumerate(cases, 1):
    rec = _base_record(case)
    if case.config is not None:
      mesh = mesh_lib.axis_sizes(case.config.mesh, n, args.num_slices)
      rec.set(**aot.record(case, mesh, out, [pathlib.Path(d) for d in args.reports], not args.no_compile))
    records.append(rec)
    if rec.status == "estimate" and rec.est_step_s is not None:
      log.info("[%d/%d] %s %s: %s; est. step %.3g s (%s bound), est. MFU %.1f%% (%s)", i, len(cases), case.strategy,
               rec.length, "fits" if rec.fits else rec.reason, rec.est_step_s, rec.est_bound,
               100 * rec.est_mfu, rec.source)
      if rec.est_step_s_range:
        log.info("  with %s's measured range of kernel efficiency %s: est. step %.3g-%.3g s, est. MFU %.1f-%.1f%%",
                 rec.kernel, rec.est_kernel_efficiency, *rec.est_step_s_range,
                 *(100 * m for m in rec.est_mfu_range))
    else:
      log.info("[%d/%d] %s %s: %s: %s", i, len(cases), case.strategy, rec.length, rec.status,
               rec.reason or "")
  slices = f" × {args.num_slices} slices" if args.num_slices > 1 else ""
  where = f"{config.model.preset or 'model'} on {topo.name}{slices} ({n} devices), estimates"
  setup = (f"Compiled ahead of time for {topo.name}{slices} = {topo.chips * args.num_slices} chips, {n} devices "
           f"({topo.generation.device_kind}, {topo.hbm_bytes / 2**30:.2f} GiB HBM per device); {_model_line(config)}.")
  return records, where, setup


def run(args: argparse.Namespace) -> int:
  config = config_lib.load(args.config, args.overrides)
  if args.topology:  # every case is compiled for it (maxctx.compile reads the config's compile section)
    config = config.replace(**{"compile.topology": args.topology, "compile.num_slices": args.num_slices})
  strategies = cases_lib.parse_strategies(args.strategies)
  lengths = cases_lib.lengths(args.lengths or (DEFAULT_TOPOLOGY_LENGTHS if args.topology else DEFAULT_LENGTHS))
  if args.steps < 1 or args.trace_steps < 1 or args.rounds < 1:
    raise ConfigError(f"--steps {args.steps}, --trace-steps {args.trace_steps} and --rounds {args.rounds} must all be "
                      "at least 1.")
  if args.rounds > 1 and args.topology:
    raise ConfigError("--rounds times runs on the devices present, and --topology runs nothing; drop one of them.")
  out = pathlib.Path(args.out or f"{config.run.output_dir}/bench" + (f"-{args.topology}" if args.topology else ""))
  if args.topology:
    from maxctx import topology as topology_lib
    from maxctx.bench import roofline
    topo = topology_lib.resolve(args.topology)
    roofline.chip_for(topo)  # a chip without roofline figures stops here, before any compile
    n, slices, platform = topo.devices * args.num_slices, args.num_slices, "tpu"
  else:
    import jax
    from maxctx import mesh as mesh_lib
    n, slices, platform = len(jax.devices()), mesh_lib.num_slices_of(jax.devices()), None
  steps = 1 + args.steps * args.rounds + args.trace_steps
  cases = cases_lib.plan(config, strategies, lengths, n, slices, args.context, steps, platform)
  cases = in_length_order(cases + also_cases(args, n, slices, steps, platform))
  out.mkdir(parents=True, exist_ok=True)  # Only now: a refused command leaves nothing behind.
  log.info("%d runs (%s × %s%s) into %s", len(cases), ",".join(strategies), ",".join(map(cases_lib.tokens, lengths)),
           "".join(f", --also {p}" for p in args.also), out)
  if args.topology:
    records, where, setup = estimate_all(config, cases, args, out)
    text = report.markdown_estimates(records, f"Strategy estimates on {args.topology}", setup, roofline.table())
  else:
    records, where, setup = measure_all(config, cases, args)
    text = report.markdown_measured(records, "Strategy benchmark", setup)
  report.write_jsonl(records, out / "results.jsonl")
  (out / "results.md").write_text(text)
  plots.plots(records, out, where, estimate=bool(args.topology))
  report.tensorboard(records, out / "tensorboard", f"bench/{args.topology}" if args.topology else "bench")
  print(text)
  log.info("wrote %s: results.jsonl, results.md, tokens_per_s.png, memory.png, comm_share.png, tensorboard/", out)
  spread = {k: v for k, v in report.loss_spread(records).items() if v > report.LOSS_TOLERANCE}
  if spread and config.model.dtype == "float32":
    print(f"error: last-step losses disagree across strategies by more than {report.LOSS_TOLERANCE:g} at "
          + ", ".join(f"{cases_lib.tokens(n)} ({v:.2e})" for n, v in spread.items())
          + "; every strategy is exact in float32, so this is a bug.", file=sys.stderr)
    return 1
  return 0


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
  _setup_logging()
  return exit_code(lambda: run(args))


if __name__ == "__main__":
  sys.exit(main())
