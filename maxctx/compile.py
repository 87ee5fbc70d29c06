"""Ahead-of-time compile of the full train step for a TPU slice, on any machine with libtpu (the `tpu` extra):

    python -m maxctx.compile configs/recipes/llama3.1-8b-14m-ring-tpu7x-128.yml [compile.topology=v5p-128] [--json]

libtpu describes the slice (`jax.experimental.topologies`) without any TPU attached; the step is lowered on abstract,
sharded arguments and compiled by the real TPU compiler, so the memory figures are the ones the pod would see. The
report gives per-device argument / output / temp / total bytes against HBM, analytic FLOPs, the collectives in the
compiled HLO, and `fits` or `does not fit` (with the bytes over). A step that needs more HBM than the slice has is
reported, not raised: libtpu is asked (`--xla_tpu_no_crash_on_oom`) to finish such compiles so their size can be read.

`compile.topology` and `compile.num_slices` come from the config's `compile:` section or the command line.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import pathlib
import re
import sys
import tempfile
import time
from typing import Any, Callable

import yaml

from maxctx import hlo as hlo_lib
from maxctx import scopes
from maxctx import topology as topology_lib
from maxctx.errors import ConfigError, MaxctxError

log = logging.getLogger("maxctx")

USAGE = ("usage: python -m maxctx.compile CONFIG.yml [compile.topology=tpu7x-128] [compile.num_slices=1] "
         "[section.key=value ...] [--json]")
GIB = topology_lib.GIB
NO_CRASH_ON_OOM = "--xla_tpu_no_crash_on_oom=true"



@dataclasses.dataclass(frozen=True)
class CompileOptions:
  topology: str = ""
  num_slices: int = 1


# ---------------------------------------------------------------------------------------------------------------------
# Config: the `compile` section rides along with the run config.


def _split_options(path: str, overrides: list[str]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
  """(the file's `compile:` section, compile.* overrides, the other overrides)."""
  from maxctx import config as config_lib
  tree = yaml.safe_load(pathlib.Path(path).read_text()) if pathlib.Path(path).exists() else None
  section = (tree.get("compile") or {}) if isinstance(tree, dict) else {}
  ours, rest = {}, []
  for arg in overrides:
    key, value = config_lib.parse_override(arg)
    if key.startswith("compile."):
      ours[key.split(".", 1)[1]] = value
    else:
      rest.append(arg)
  return section, ours, rest


def load(path: str, overrides: list[str]):
  """(Config, CompileOptions) from a run file and `section.key=value` overrides."""
  from maxctx import config as config_lib
  section, cli, rest = _split_options(path, overrides)
  if not isinstance(section, dict):
    raise ConfigError(f"config key compile in {path} is a section and needs a mapping, not {section!r}.")
  names = [f.name for f in dataclasses.fields(CompileOptions)]
  for where, keys in ((path, section), ("the command line", cli)):
    for key in keys:
      if key not in names:
        raise ConfigError(f"unknown config key compile.{key} in {where}; the compile keys are "
                          f"{', '.join('compile.' + n for n in names)}.")
  merged = {**section, **cli}
  try:
    options = CompileOptions(topology=str(merged.get("topology", "")), num_slices=int(merged.get("num_slices", 1)))
  except (TypeError, ValueError):
    raise ConfigError(f"compile.num_slices must be a positive integer, got {merged.get('num_slices')!r}.") from None
  if options.num_slices < 1:
    raise ConfigError(f"compile.num_slices is {options.num_slices}; a job has at least one slice.")
  if not options.topology:
    raise ConfigError(f"no TPU topology to compile for: add compile.topology=<type> (e.g. tpu7x-128) to the command "
                      f"line or a `compile:` section to {path}.")
  if "compile" in {f.name for f in dataclasses.fields(config_lib.Config)}:
    return config_lib.load(path, rest + [f"compile.{k}={v}" for k, v in cli.items()]), options
  # The config schema has no compile section: hand config.load the file without it.
  tree = config_lib._read_yaml(pathlib.Path(path))
  tree.pop("compile", None)
  with tempfile.NamedTemporaryFile("w", suffix=".yml", prefix=pathlib.Path(path).stem + "-") as f:
    yaml.safe_dump(tree, f)
    f.flush()
    try:
      return config_lib.load(f.name, rest), options
    except ConfigError as e:
      raise ConfigError(str(e).replace(f.name, str(path))) from None


# ---------------------------------------------------------------------------------------------------------------------
# Compiling.


def ensure_libtpu_flags() -> None:
  """Asks libtpu to finish compiles that exceed HBM, so the report can say by how much. Must run before libtpu loads
  (the first topology description), which is why this module imports jax lazily."""
  flags = os.environ.get("LIBTPU_INIT_ARGS", "")
  if "xla_tpu_no_crash_on_oom" not in flags:
    os.environ["LIBTPU_INIT_ARGS"] = f"{flags} {NO_CRASH_ON_OOM}".strip()
  # libtpu takes a lock so that two processes do not drive the same chips; a machine without chips has none to
  # share, and several compiles (e.g. pytest -n 2) may run at once.
  if not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*"):
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "true")


def topology_devices(topo: topology_lib.Topology, num_slices: int = 1) -> list:
  """Compile-only devices of `num_slices` slices of `topo` (no TPU needed, only libtpu)."""
  ensure_libtpu_flags()
  from jax.experimental import topologies
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topo.libtpu_name, num_slices=num_slices)
  except ImportError as e:
    raise ConfigError(f"compiling for {topo.name} needs libtpu: install the tpu extra (pip install -e '.[tpu]'); "
                      f"{e}") from None
  except RuntimeError as e:
    if "lockfile" in str(e):
      raise ConfigError(f"libtpu is held by another process ({str(e).splitlines()[0]}); wait for it or set "
                        "ALLOW_MULTIPLE_LIBTPU_LOAD=true.") from None
    # jax says "JAX TPU support not installed" when libtpu is absent; older releases named libtpu or "not found".
    text = str(e).lower()
    if "libtpu" in text or "tpu" in text and ("not found" in text or "not installed" in text):
      raise ConfigError(f"compiling for {topo.name} needs libtpu, which did not load ({str(e).splitlines()[0]}); "
                        "install the tpu extra: pip install -e '.[tpu]'.") from None
    raise
  return list(desc.devices)


def abstract_args(trainer, config) -> tuple[Any, dict[str, Any]]:
  """ShapeDtypeStructs with shardings for (state, batch): what the step is lowered on; nothing is allocated."""
  import jax
  import jax.numpy as jnp
  from maxctx.data import FIELDS
  shapes = jax.eval_shape(trainer.init, jax.random.key(0))
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                       trainer.state_shardings)
  d = config.data
  batch = {k: jax.ShapeDtypeStruct((d.batch_size, d.seq_len), jnp.int32, sharding=trainer.batch_shardings)
           for k in FIELDS}
  return state, batch


_OOM_TOTAL = re.compile(r"memory required for [^(]*\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)")
_OOM_ALLOC = re.compile(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_oom(message: str) -> dict[str, Any]:
  """What a RESOURCE_EXHAUSTED compile error says about the bytes needed (a lower bound if only one buffer is named)."""
  if m := _OOM_TOTAL.search(message):
    return {"required_bytes": int(float(m.group(1)) * _UNITS[m.group(2)]), "required_is_lower_bound": False,
            "hbm_reported_bytes": int(float(m.group(3)) * _UNITS[m.group(4)])}
  if m := _OOM_ALLOC.search(message):
    return {"required_bytes": int(m.group(1)), "required_is_lower_bound": True,
            "hbm_reported_bytes": int(m.group(2))}
  return {"required_bytes": None, "required_is_lower_bound": True, "hbm_reported_bytes": None}


def compile_for(config, options: CompileOptions,
                inspect: Callable[[Any], dict[str, Any]] | None = None) -> dict[str, Any]:
  """Compiles `config`'s train step for `options.topology`; returns the report as a dict (see `format_report`).
  `inspect(compiled)`, when given, adds its dict to the report of a step that compiled (maxctx.bench reads the
  collectives' bytes from the HLO this way, without compiling twice)."""
  topo = topology_lib.resolve(options.topology)
  devices = topology_devices(topo, options.num_slices)
  import jax
  from maxctx import mesh as mesh_lib
  from maxctx import metrics as metrics_lib
  from maxctx import trainer as trainer_lib

  n = len(devices)
  sizes = _validate(trainer_lib, config, n, options.num_slices)
  mesh = mesh_lib.build_mesh(config.mesh, devices)
  m, d = config.model, config.data
  flops = metrics_lib.flops_per_step(m, d.batch_size, d.seq_len)
  peak_tflops = topo.generation.chip.tflops_per_device
  report: dict[str, Any] = {
      "config": config.run.name, "topology": topo.name, "libtpu_topology": topo.libtpu_name,
      "num_slices": options.num_slices, "devices": n, "chips": topo.chips * options.num_slices,
      "device_kind": devices[0].device_kind, "mesh": {a: int(s) for a, s in mesh.shape.items()},
      "strategy": config.attention.strategy, "kernel": config.attention.kernel,
      "seq_len": d.seq_len, "batch_size": d.batch_size, "tokens_per_device": d.batch_size * d.seq_len // n,
      "context_degree": sizes["context"], "remat": m.remat, "loss_chunk": m.loss_chunk, "mlp_chunk": m.mlp_chunk,
      "block_q": config.attention.block_q, "block_kv": config.attention.block_kv,
      "params": metrics_lib.param_count(m),
      "flops_per_step": flops, "flops_per_device": flops / n,
      "seconds_at_peak": flops / n / (peak_tflops * 1e12) if peak_tflops else None,
      "hbm_per_device_bytes": topo.hbm_bytes,
  }
  start = time.perf_counter()
  # The abstract mesh: tracing sees the axis sizes, and nothing (not even the init's PRNG key) is placed on the
  # compile-only devices, which cannot hold data.
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    trainer = trainer_lib.Trainer(config, mesh)
    state, batch = abstract_args(trainer, config)
    lowered = trainer.step.lower(state, batch)
    try:
      compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      # Over HBM, libtpu either says so (RESOURCE_EXHAUSTED) or, with --xla_tpu_no_crash_on_oom, may finish with a
      # program it then refuses to load (INVALID_ARGUMENT: Invalid TPU program); both mean "does not fit".
      if "RESOURCE_EXHAUSTED" not in str(e) and "Invalid TPU program" not in str(e):
        raise
      compiled, message = None, str(e)
  report["compile_seconds"] = round(time.perf_counter() - start, 1)
  if compiled is None:
    oom = parse_oom(message)
    needed = oom["required_bytes"]
    report.update(memory=None, compiler_flops=None, collectives=None, attention_collectives=None, fits=False,
                  over_bytes=None if needed is None else max(0, needed - topo.hbm_bytes),
                  required_bytes=needed, required_is_lower_bound=oom["required_is_lower_bound"],
                  error=message.splitlines()[0][:500])
    return report
  mem = compiled.memory_analysis()
  memory = {"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
            "alias": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes,
            "code": mem.generated_code_size_in_bytes,
            # What `remat: full_offload` moves out of HBM: the saved layer inputs, in the host's pinned memory.
            "host_temp": getattr(mem, "host_temp_size_in_bytes", 0) or 0}
  # The state is donated: its output aliases its argument and is counted once (MaxText reports the same sum).
  memory["total"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
  hlo = compiled.as_text()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  report.update(memory=memory, fits=memory["total"] <= topo.hbm_bytes,
                over_bytes=max(0, memory["total"] - topo.hbm_bytes),
                compiler_flops=(cost or {}).get("flops"), collectives=hlo_lib.instruction_counts(hlo),
                # The model's `attention` scope holds the strategy's own communication; the rest is ZeRO-3's
                # parameter all-gathers and gradient reduce-scatters.
                attention_collectives=hlo_lib.instruction_counts(hlo, scopes.ATTENTION))
  if inspect is not None:
    report.update(inspect(compiled))
  return report


def _validate(trainer_lib, config, num_devices: int, num_slices: int) -> dict[str, int]:
  # Kernels are checked against the platform that will run them (TPU), not the host's.
  return trainer_lib.validate(config, num_devices, num_slices, platform="tpu")


# ---------------------------------------------------------------------------------------------------------------------
# Report.


def _gib(n: int | None) -> str:
  if n is None:
    return "?"
  return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / 2**20:.1f} MiB"


def _counts(counts: dict[str, int]) -> str:
  return ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "none"


def format_report(r: dict[str, Any]) -> str:
  mesh = " × ".join(f"{a}={s}" for a, s in r["mesh"].items() if s > 1) or "1 device"
  slices = f" × {r['num_slices']} slices" if r["num_slices"] > 1 else ""
  lines = [
      f"{r['config']}: {r['strategy']} ({r['kernel']} kernel) on {r['topology']}{slices} "
      f"= {r['chips']} chips, {r['devices']} devices ({r['device_kind']}); mesh {mesh}",
      f"  sequence {r['seq_len']:,} tokens × batch {r['batch_size']}: {r['tokens_per_device']:,} tokens per device; "
      f"remat {r['remat']}, loss_chunk {r['loss_chunk']}, mlp_chunk {r.get('mlp_chunk', 0) or 'off'}, "
      f"blocks q={r['block_q'] or 'default'} "
      f"kv={r['block_kv'] or 'default'}",
      f"  FLOPs (analytic): {r['flops_per_step']:.3e} per step, {r['flops_per_device']:.3e} per device"
      + (f" = {r['seconds_at_peak']:.3g} s per step at peak" if r.get("seconds_at_peak") else ""),
  ]
  hbm = r["hbm_per_device_bytes"]
  if r["memory"] is None:
    needed = r.get("required_bytes")
    bound = "at least " if r.get("required_is_lower_bound") else ""
    need = f"needs {bound}{_gib(needed)}" if needed is not None else "the compiler gave no size"
    lines += [f"  memory per device: compile ran out of HBM; {need} of {_gib(hbm)}",
              f"  compiler: {r['error']}",
              f"  does not fit" + (f": {bound}{_gib(r['over_bytes'])} over" if r["over_bytes"] is not None else "")]
    return "\n".join(lines)
  mem = r["memory"]
  lines += [
      f"  memory per device: argument {_gib(mem['argument'])}, output {_gib(mem['output'])} "
      f"(aliased {_gib(mem['alias'])}), temp {_gib(mem['temp'])}; total {_gib(mem['total'])} of {_gib(hbm)} HBM "
      f"({100 * mem['total'] / hbm:.0f}%)"
      + (f"; host memory {_gib(mem['host_temp'])} (offloaded)" if mem.get("host_temp") else ""),
      f"  collectives in the compiled step: {_counts(r['collectives'])}; in attention: "
      f"{_counts(r['attention_collectives'])}",
      f"  compiled in {r['compile_seconds']:.0f} s",
      "  fits" if r["fits"] else f"  does not fit: {_gib(r['over_bytes'])} over",
  ]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] in ("-h", "--help"):
    print(USAGE)
    return 0 if argv else 2
  as_json = "--json" in argv
  args = [a for a in argv if a != "--json"]
  # The report goes to stdout; progress and libtpu's chatter to stderr, so `--json > report.json` stays clean.
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
  try:
    config, options = load(args[0], args[1:])
    log.info("compiling %s for %s ...", args[0], options.topology)
    report = compile_for(config, options)
  except MaxctxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(report, indent=2) if as_json else format_report(report))
  return 0


if __name__ == "__main__":
  sys.exit(main())
