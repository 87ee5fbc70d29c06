"""What `python -m maxctx.compile` found for one step on a TPU slice: the compiled memory per device (and in each host
VM's RAM), the collectives, whether it fits, and the text the command prints. JSON only at the edges (`--json`,
maxctx.bench's cache, the launcher's `--fit-report`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from maxctx import chips as chips_lib
from maxctx import topology as topology_lib

GIB = topology_lib.GIB


@dataclasses.dataclass(frozen=True)
class Memory:
  """Per-device bytes of the compiled step (`memory_analysis()`); `host_temp` is what `remat: full_offload` keeps
  in the host's pinned memory."""
  argument: int
  output: int
  alias: int
  temp: int
  code: int
  host_temp: int = 0

  @property
  def total(self) -> int:
    # The state is donated: its output aliases its argument and is counted once (MaxText reports the same sum).
    return self.argument + self.output - self.alias + self.temp


@dataclasses.dataclass(frozen=True)
class CompileReport:
  """What `compile_for` found; JSON (`to_json`, `from_json`) only at the edges: `--json`, bench's cache."""
  config: str
  topology: str
  libtpu_topology: str
  num_slices: int
  devices: int
  chips: int
  device_kind: str
  mesh: dict[str, int]
  strategy: str
  kernel: str
  seq_len: int
  batch_size: int
  tokens_per_device: int
  context_degree: int
  remat: str
  loss_chunk: int
  mlp_chunk: int
  block_q: int | None
  block_kv: int | None
  params: int
  flops_per_step: float
  flops_per_device: float
  seconds_at_peak: float | None
  hbm_per_device_bytes: int
  compile_seconds: float = 0.0
  fits: bool = False
  over_bytes: int | None = None
  memory: Memory | None = None          # None: the compiler ran out of HBM (see required_bytes, error)
  compiler_flops: float | None = None
  collectives: dict[str, int] | None = None
  attention_collectives: dict[str, int] | None = None
  required_bytes: int | None = None
  required_is_lower_bound: bool = False
  error: str | None = None
  inspected: dict[str, Any] = dataclasses.field(default_factory=dict)  # what compile_for's `inspect` added
  step: dict[str, Any] | None = None    # `step_key` of the config compiled (None in reports from before it)
  devices_per_host: int | None = None   # JAX devices one host VM of the slice drives
  host_ram_bytes: int | None = None     # one host VM's RAM (maxctx/chips.py)

  @property
  def remat_group(self) -> int:
    """model.remat_group of the step compiled (1 in reports from before it; `step` None: not recorded)."""
    return ((self.step or {}).get("model") or {}).get("remat_group", 1)

  @property
  def host_bytes_per_host(self) -> int:
    """What `remat: full_offload` keeps in one host VM's memory: its devices' offloaded bytes together."""
    return (self.memory.host_temp if self.memory else 0) * (self.devices_per_host or 1)

  @property
  def host_fits(self) -> bool:
    """Whether that is within the share of the VM's RAM that maxctx.train allows it (True where the RAM is unknown)."""
    ram = self.host_ram_bytes
    return ram is None or self.host_bytes_per_host <= chips_lib.HOST_MEMORY_SHARE * ram

  @property
  def total_bytes(self) -> int | None:
    """The compiled total per device, or what the compiler said it needed when it ran out of HBM."""
    return self.memory.total if self.memory is not None else self.required_bytes

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    if self.memory is not None:
      out["memory"]["total"] = self.memory.total
    return out

  @classmethod
  def from_json(cls, tree: dict[str, Any]) -> CompileReport:
    """A report read back; keys it does not know (older or newer reports) are dropped."""
    names = {f.name for f in dataclasses.fields(cls)}
    tree = {k: v for k, v in tree.items() if k in names}
    tree.setdefault("mlp_chunk", 0)  # a report from before model.mlp_chunk was compiled without chunking
    if isinstance((tree.get("step") or {}).get("model"), dict):   # and one from before model.remat_group, ungrouped
      tree["step"] = {**tree["step"], "model": {"remat_group": 1, **tree["step"]["model"]}}
    if tree.get("memory") is not None:
      tree["memory"] = Memory(**{k: v for k, v in tree["memory"].items() if k != "total"})
    return cls(**tree)


def _gib(n: int | None) -> str:
  if n is None:
    return "?"
  return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / 2**20:.1f} MiB"


def _counts(counts: dict[str, int]) -> str:
  return ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "none"


def format_report(r: CompileReport) -> str:
  mesh = " × ".join(f"{a}={s}" for a, s in r.mesh.items() if s > 1) or "1 device"
  slices = f" × {r.num_slices} slices" if r.num_slices > 1 else ""
  remat = r.remat + (f" in groups of {r.remat_group} layers" if r.remat_group > 1 else "")
  lines = [
      f"{r.config}: {r.strategy} ({r.kernel} kernel) on {r.topology}{slices} "
      f"= {r.chips} chips, {r.devices} devices ({r.device_kind}); mesh {mesh}",
      f"  sequence {r.seq_len:,} tokens × batch {r.batch_size}: {r.tokens_per_device:,} tokens per device; "
      f"remat {remat}, loss_chunk {r.loss_chunk}, mlp_chunk {r.mlp_chunk or 'off'}, "
      f"blocks q={r.block_q or 'default'} kv={r.block_kv or 'default'}",
      f"  FLOPs (analytic): {r.flops_per_step:.3e} per step, {r.flops_per_device:.3e} per device"
      + (f" = {r.seconds_at_peak:.3g} s per step at peak" if r.seconds_at_peak else ""),
  ]
  hbm = r.hbm_per_device_bytes
  if r.memory is None:
    bound = "at least " if r.required_is_lower_bound else ""
    need = f"needs {bound}{_gib(r.required_bytes)}" if r.required_bytes is not None else "the compiler gave no size"
    lines += [f"  memory per device: compile ran out of HBM; {need} of {_gib(hbm)}",
              f"  compiler: {r.error}",
              "  does not fit" + (f": {bound}{_gib(r.over_bytes)} over" if r.over_bytes is not None else "")]
    return "\n".join(lines)
  mem = r.memory
  lines += [
      f"  memory per device: argument {_gib(mem.argument)}, output {_gib(mem.output)} "
      f"(aliased {_gib(mem.alias)}), temp {_gib(mem.temp)}; total {_gib(mem.total)} of {_gib(hbm)} HBM "
      f"({100 * mem.total / hbm:.0f}%)",
      *([_host_line(r)] if mem.host_temp else []),
      f"  collectives in the compiled step: {_counts(r.collectives)}; in attention: "
      f"{_counts(r.attention_collectives)}",
      f"  compiled in {r.compile_seconds:.0f} s",
      "  fits" if r.fits else f"  does not fit: {_gib(r.over_bytes)} over" if r.over_bytes else
      "  does not fit: host memory",
  ]
  return "\n".join(lines)


def _host_line(r: CompileReport) -> str:
  line = f"  host memory (offloaded): {_gib(r.memory.host_temp)} per device"
  if r.devices_per_host and r.host_ram_bytes:
    share = r.host_bytes_per_host / r.host_ram_bytes
    line += (f", {_gib(r.host_bytes_per_host)} per host VM ({r.devices_per_host} devices) of its "
             f"{_gib(r.host_ram_bytes)} RAM ({share:.0%}; maxctx.train allows {chips_lib.HOST_MEMORY_SHARE:.0%})")
  return line
