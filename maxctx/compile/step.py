"""Ahead-of-time compile of the full train step for a TPU slice, on any machine with libtpu (the `tpu` extra); the
command is maxctx/compile/__main__.py:

    python -m maxctx.compile configs/recipes/llama3.1-8b-14m-ring-tpu7x-128.yml [compile.topology=v5p-128] [--json]

libtpu describes the slice (`jax.experimental.topologies`) without any TPU attached; the step is lowered on abstract,
sharded arguments and compiled by the real TPU compiler, so the memory figures are the ones the pod would see. The
report gives per-device argument / output / temp / total bytes against HBM, analytic FLOPs, the collectives in the
compiled HLO, what `remat: full_offload` keeps in each host VM's RAM, and `fits` or `does not fit` (with the bytes
over; a step fits when its HBM does and its host memory is at most the share of the VM's RAM that maxctx.train allows
itself, maxctx/chips.py's HOST_MEMORY_SHARE). A step that needs more HBM than the slice has is reported, not raised:
libtpu is asked (`--xla_tpu_no_crash_on_oom`) to finish such compiles so their size can be read.

`compile.topology` and `compile.num_slices` are keys of the run config (its `compile:` section or the command line).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import time
from typing import Any, Callable

from maxctx import config as config_lib
from maxctx import scopes
from maxctx import topology as topology_lib
from maxctx.compile import hlo as hlo_lib
from maxctx.compile.report import CompileReport, Memory
from maxctx.config import Config
from maxctx.errors import ConfigError

GIB = topology_lib.GIB
NO_CRASH_ON_OOM = "--xla_tpu_no_crash_on_oom=true"


def load(path: str, overrides: list[str]) -> Config:
  """The run config with its `compile` section (topology, slices) from a run file and `section.key=value`
  overrides; refuses one that names no topology."""
  config = config_lib.load(path, overrides)
  if not config.compile.topology:
    raise ConfigError(f"no TPU topology to compile for: add compile.topology=<type> (e.g. tpu7x-128) to the command "
                      f"line or a `compile:` section to {path}.")
  config_lib.check(config.compile, "compile.")
  return config


def step_key(config: Config) -> dict[str, Any]:
  """What a compile proves fit for: the topology and slice count, the mesh (its -1 resolved) and every key that
  shapes the step's buffers (model, attention, tokens per batch, gradient accumulation). Configs with equal keys
  compile to the same step whatever else differs (run name, steps, data source, learning rate, output dir)."""
  from maxctx import mesh as mesh_lib
  topo = topology_lib.resolve(config.compile.topology)
  num_slices = config.compile.num_slices
  ici, dcn = mesh_lib.resolve_axes(config.mesh, topo.devices * num_slices, num_slices)
  return {"topology": topo.name, "num_slices": num_slices, "mesh": {"ici": ici, "dcn": dcn},
          "model": dataclasses.asdict(config.model), "attention": dataclasses.asdict(config.attention),
          "data": {"seq_len": config.data.seq_len, "batch_size": config.data.batch_size},
          "optim": {"grad_accum": config.optim.grad_accum}}


def first_difference(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> tuple[str, Any, Any] | None:
  """(dotted key, a's value, b's value) of the first key in which two nested dicts differ, or None."""
  for key in list(a) + [k for k in b if k not in a]:
    x, y = a.get(key), b.get(key)
    if isinstance(x, dict) and isinstance(y, dict):
      if found := first_difference(x, y, f"{prefix}{key}."):
        return found
    elif x != y:
      return f"{prefix}{key}", x, y
  return None


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
  state = trainer.abstract_state()
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


def compile_for(config: Config, inspect: Callable[[Any], dict[str, Any]] | None = None) -> CompileReport:
  """Compiles `config`'s train step for its `compile.topology` and `compile.num_slices`. `inspect(compiled)`, when
  given, reads what else it wants from a step that compiled into the report's `inspected` (maxctx.bench reads the
  collectives' bytes from the HLO this way, without compiling twice)."""
  topo = topology_lib.resolve(config.compile.topology)
  num_slices = config.compile.num_slices
  devices = topology_devices(topo, num_slices)
  import jax
  from maxctx import mesh as mesh_lib
  from maxctx import metrics as metrics_lib
  from maxctx import trainer as trainer_lib

  n = len(devices)
  sizes = validate_for_tpu(config, n, num_slices)
  mesh = mesh_lib.build_mesh(config.mesh, devices)
  m, d, a = config.model, config.data, config.attention
  flops = metrics_lib.flops_per_step(m, d.batch_size, d.seq_len)
  peak_tflops = topo.generation.chip.tflops_per_device
  shape = dict(
      config=config.run.name, topology=topo.name, libtpu_topology=topo.libtpu_name, num_slices=num_slices,
      devices=n, chips=topo.chips * num_slices, device_kind=devices[0].device_kind,
      mesh={ax: int(sz) for ax, sz in mesh.shape.items()}, strategy=a.strategy, kernel=a.kernel,
      seq_len=d.seq_len, batch_size=d.batch_size, tokens_per_device=d.batch_size * d.seq_len // n,
      context_degree=sizes["context"], remat=m.remat, loss_chunk=m.loss_chunk, mlp_chunk=m.mlp_chunk,
      block_q=a.block_q, block_kv=a.block_kv, params=metrics_lib.param_count(m), flops_per_step=flops,
      flops_per_device=flops / n, seconds_at_peak=flops / n / (peak_tflops * 1e12) if peak_tflops else None,
      hbm_per_device_bytes=topo.hbm_bytes, step=step_key(config), devices_per_host=topo.devices_per_host,
      host_ram_bytes=topo.generation.chip.host_ram_bytes)
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
  seconds = round(time.perf_counter() - start, 1)
  if compiled is None:
    oom = parse_oom(message)
    needed = oom["required_bytes"]
    return CompileReport(**shape, compile_seconds=seconds, fits=False,
                         over_bytes=None if needed is None else max(0, needed - topo.hbm_bytes),
                         required_bytes=needed, required_is_lower_bound=oom["required_is_lower_bound"],
                         error=message.splitlines()[0][:500])
  mem = compiled.memory_analysis()
  memory = Memory(argument=mem.argument_size_in_bytes, output=mem.output_size_in_bytes,
                  alias=mem.alias_size_in_bytes, temp=mem.temp_size_in_bytes, code=mem.generated_code_size_in_bytes,
                  host_temp=getattr(mem, "host_temp_size_in_bytes", 0) or 0)
  hlo = compiled.as_text()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  report = CompileReport(
      **shape, compile_seconds=seconds, memory=memory, fits=memory.total <= topo.hbm_bytes,
      over_bytes=max(0, memory.total - topo.hbm_bytes), compiler_flops=(cost or {}).get("flops"),
      collectives=hlo_lib.instruction_counts(hlo),
      # The model's `attention` scope holds the strategy's own communication; the rest is ZeRO-3's parameter
      # all-gathers and gradient reduce-scatters.
      attention_collectives=hlo_lib.instruction_counts(hlo, scopes.ATTENTION),
      inspected=inspect(compiled) if inspect is not None else {})
  return dataclasses.replace(report, fits=report.fits and report.host_fits)   # the host VM's RAM, too


def validate_for_tpu(config, num_devices: int, num_slices: int) -> dict[str, int]:
  """maxctx.train's start-up checks for `num_devices` TPU devices in `num_slices` slices; the mesh's axis sizes.
  Kernels are checked against the platform that will run them (TPU), not the host's."""
  from maxctx import trainer as trainer_lib
  return trainer_lib.validate(config, num_devices, num_slices, platform="tpu")
