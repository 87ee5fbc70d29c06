"""Estimated step time and MFU on a TPU slice from a compiled (not run) step: a roofline. Every number this module
returns is an estimate, and is labelled so wherever it is printed or plotted.

The model, per device, from the compile report of `maxctx.compile.step.compile_for` and the step's collective bytes
(maxctx.compile.hlo, loop trip counts included):
  compute  = analytic model FLOPs per device × 4/3 under `remat: full` or `full_offload` (the forward runs twice;
             × 5/3 with model.remat_group > 1, where it runs three times);
             under `save_attention_out`, `save_dots` and `none` plus the forward FLOPs they rerun when the caller
             gives them (`recomputed_flops`: the projections and the MLP, or attention, or a chunked
             MLP's gate and up), else none
             / peak bf16 FLOP/s
  memory   = (argument + output + 2 × temp bytes) / HBM bandwidth: each byte the step holds is written or read at
             least once, so this is a lower bound on HBM traffic, not a measurement of it
  network  = bytes per ICI link / one link's bandwidth in one direction, where a collective-permute (a ring hop to a
             neighbour) uses one link, and the other collectives spread over all of the chip's links, shared by the
             chip's devices
  step     = max(compute, memory, network): perfect overlap, the roofline bound (the no-overlap sum is reported too)
  MFU      = model FLOPs per step / (step × devices × peak per device); tokens/s = tokens per step / step
The peak assumes the matmuls run at the chip's bf16 peak, which no attention kernel reaches, so `est_step_s` is a
ceiling, not a forecast. For a kernel with a measured comparable (`KERNEL_EFFICIENCY`: flash) the estimate also gives
`est_step_s_range` and `est_mfu_range`: compute at the low and high measured share of peak (the whole step's FLOPs,
since at millions of tokens attention is nearly all of them). The pure-JAX blockwise kernel has no such measurement
here; its real step times will be longer than the ceiling by an unknown factor. Not modelled: the host transfers of
`remat: full_offload` (its saved layer inputs go to host memory and back once per step), and DCN, which is listed for
multi-slice work but not used (single slice only). The chips' figures and their sources are maxctx/chips.py's.
"""

from __future__ import annotations

from typing import Any

from maxctx import chips
from maxctx import metrics
from maxctx import topology as topology_lib
from maxctx.compile.report import CompileReport
from maxctx.config import Config
from maxctx.errors import ConfigError

GB = 1e9


# The share of the bf16 peak that a fused Pallas attention kernel on a TPU has been measured to reach, (low, high),
# from comparable kernels (maxctx's flash has not run on a TPU yet):
#   high 0.73: Ragged Paged Attention (Pallas/Mosaic; J. Jiang et al., arXiv:2604.15464), Llama 3 8B prefill on TPU7x,
#              73% MFU: a forward-only kernel tuned by its authors, so an upper end for a training step's kernels.
#   low 0.037: JAX's Pallas TPU flash_attention at its default 128-wide blocks, bf16 on one v5e chip: 7.3 TFLOP/s of
#              197 (github.com/jax-ml/jax/issues/24633): an untuned kernel with blocks too small for the MXU; the
#              recipes use 1,024-wide blocks, so this is a floor, not an expectation.
KERNEL_EFFICIENCY: dict[str, tuple[float, float]] = {"flash": (0.037, 0.73)}


def chip_for(topo: topology_lib.Topology) -> chips.Chip:
  chip = topo.generation.chip
  if not chip.has_roofline:
    known = ", ".join(k for k, c in chips.CHIPS.items() if c.has_roofline)
    raise ConfigError(f"no roofline figures for {topo.generation.prefix} (TPU type {topo.name}); the estimate knows "
                      f"{known}: add its HBM and ICI figures to maxctx/chips.py CHIPS with their source.")
  return chip


def table() -> str:
  """The roofline's inputs as a Markdown table (printed with every estimate, so the numbers carry their basis)."""
  lines = ["| chip | peak bf16 TFLOP/s | HBM GB/s | ICI GB/s (bidir., per chip) | ICI links | GB/s per link, one way | "
           "DCN Gb/s |", "|---|---:|---:|---:|---:|---:|---:|"]
  for c in (c for c in chips.CHIPS.values() if c.has_roofline):
    lines.append(f"| {c.name} | {c.bf16_tflops:,.0f} | {c.hbm_gb_s:,.0f} | {c.ici_gb_s:,.0f} | {c.ici_links} | "
                 f"{c.link_gb_s:,.0f} | {c.dcn_gbit_s:,.0f} |")
  return "\n".join(lines)


def bytes_per_link(sent: dict[str, float], chip: chips.Chip, per_chip: int) -> float:
  """Bytes per ICI link of one device's collectives by kind: a ring hop (collective-permute or -broadcast) uses one
  link; the rest spread over all of the chip's links, shared by its devices."""
  ring = sent.get("collective-permute", 0) + sent.get("collective-broadcast", 0)
  return ring + (sum(sent.values()) - ring) / (chip.ici_links / per_chip)


def forward_runs(m) -> int:
  """How often a layer's forward runs per step under `full` or `full_offload`: once, and again in its backward; with
  model.remat_group > 1 once more, where its group's backward reruns the group to recover its layers' inputs (the
  scan reruns every layer of the group, the last one's output unused: maxctx.model.transformer.grouped_layers)."""
  return 3 if m.remat_group > 1 else 2


def recomputed_flops(config: Config, sizes: dict[str, int] | None = None) -> float:
  """The forward FLOPs that remat runs again in the backward: the layers' whole forward under `full` and
  `full_offload` (twice with model.remat_group > 1: `forward_runs`); their projections and MLP under
  `save_attention_out` (attention's output and softmax statistics are kept, so attention itself is not rerun);
  attention alone under `save_dots` (its output is no dot, and the output projection's gradient needs it); nothing
  under `none`. A chunked MLP (model.mlp_chunk below the tokens per device of mesh `sizes`) rematerializes each step,
  so under `none` its gate and up projections run again; under the other policies it costs nothing more (counted: the
  dot FLOPs of the compiled CPU step, loops' trip counts included, are the same chunked and not under them, and
  greater by exactly those two projections under `none`)."""
  m, d = config.model, config.data
  tokens = d.batch_size * d.seq_len
  weights = 2.0 * (metrics.matmul_params(m) - m.d_model * m.vocab_size) * tokens
  attention_core = (metrics.flops_per_step(m, d.batch_size, d.seq_len) - 6.0 * metrics.matmul_params(m) * tokens) / 3
  forward = weights + attention_core
  again = (forward_runs(m) - 1) * forward
  out = {"full": again, "full_offload": again, "save_attention_out": weights, "save_dots": attention_core,
         "none": 0.0}[m.remat]
  local = d.seq_len // (sizes or {}).get("context", 1)
  if m.remat == "none" and 0 < m.mlp_chunk < local:
    out += 2.0 * 2 * m.d_model * m.d_ff * m.n_layers * tokens
  return out


def estimate(report: CompileReport, topo: topology_lib.Topology,
             recomputed_flops: float | None = None) -> dict[str, Any]:
  """The roofline estimate of one compiled step (fields prefixed `est_`); empty parts stay None. `recomputed_flops`
  (per step) is what a partial remat policy runs again in the backward."""
  chip = chip_for(topo)
  per_chip = topo.generation.devices_per_chip
  peak = chip.bf16_tflops * 1e12 / per_chip
  remat = 1.0
  if report.remat in ("full", "full_offload"):   # the forward (a third of the step) once more; twice more in groups
    remat = 5 / 3 if report.remat_group > 1 else 4 / 3
  if report.remat in ("save_attention_out", "save_dots", "none") and recomputed_flops:
    remat = 1.0 + recomputed_flops / report.flops_per_step
  compute_s = report.flops_per_device * remat / peak
  out: dict[str, Any] = {"est_compute_s": compute_s, "est_memory_s": None, "est_network_s": None,
                         "est_bytes_per_link": None, "est_peak_tflops_per_device": peak / 1e12}
  mem = report.memory
  if mem:
    out["est_memory_s"] = (mem.argument + mem.output + 2 * mem.temp) / (chip.hbm_gb_s * GB / per_chip)
  coll = report.inspected.get("collective_bytes")
  if coll:
    sent = {}
    for scope in ("bytes_attention", "bytes_other"):
      for kind, b in coll[scope].items():
        sent[kind] = sent.get(kind, 0) + b
    per_link = bytes_per_link(sent, chip, per_chip)
    out["est_bytes_per_link"] = per_link
    out["est_network_s"] = per_link / (chip.link_gb_s * GB)
  parts = [(v, name) for name, v in (("compute", compute_s), ("HBM", out["est_memory_s"]),
                                      ("ICI", out["est_network_s"])) if v is not None]
  step, out["est_bound"] = max(parts)
  out["est_step_s"] = step
  out["est_step_s_no_overlap"] = sum(v for v, _ in parts)
  out["est_mfu"] = report.flops_per_step / (step * report.devices * peak)
  out["est_tokens_per_s"] = report.seq_len * report.batch_size / step
  out["est_comm_share"] = None if out["est_network_s"] is None else out["est_network_s"] / step
  efficiency = KERNEL_EFFICIENCY.get(report.kernel)
  out["est_kernel_efficiency"] = efficiency
  out["est_step_s_range"] = out["est_mfu_range"] = None
  if efficiency is not None:
    # Fast end first: compute at the high share of peak, then the low; the other parts are unchanged.
    steps = [max([compute_s / e, *(v for v, name in parts if name != "compute")]) for e in sorted(efficiency)[::-1]]
    out["est_step_s_range"] = tuple(steps)
    out["est_mfu_range"] = tuple(report.flops_per_step / (t * report.devices * peak) for t in steps)
  return out
