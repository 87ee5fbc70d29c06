"""Accelerator chips: the one table of their peak FLOP/s, memory and interconnect.

MFU (metrics), the TPU slice names (topology), the compile report and the roofline estimate all read these rows, so a
figure is changed in one place. Figures are per chip; `per_device` divides by the JAX devices a chip presents (a v7
chip is two devices, a v5p chip one: megacore).

Sources: Google Cloud TPU documentation, "TPU7x (Ironwood)" (docs.cloud.google.com/tpu/docs/tpu7x), whose
specification table lists v5p, v6e and TPU7x side by side: peak bf16 per chip 459 / 918 / 2,307 TFLOP/s (TPU7x fp8:
4,614), HBM bandwidth per chip 2,765 / 1,638 / 7,380 GB/s, bidirectional ICI bandwidth per chip 1,200 / 800 / 1,200
GB/s, DCN per chip 50 / 100 / 100 Gb/s. The v5p page (docs.cloud.google.com/tpu/docs/v5p) gives the same v5p figures
(its older version: "Interchip Interconnect BW 4,800 Gbps" = 600 GB/s one way). v5e 197 and v4 275 TFLOP/s from their
Cloud TPU pages; NVIDIA's data sheets for the GPUs (dense bf16, without sparsity). ICI links per chip are the torus
degree of the slice shapes (v5p, TPU7x: 3-D torus; v6e: 2-D), an assumption of the roofline, not a data-sheet figure.
The same TPU7x table gives each generation's host VM: 4 chips with 448 / 720 / 960 GB of RAM (v5p / v6e / TPU7x).
"""

from __future__ import annotations

import dataclasses


# `remat: full_offload` may fill at most this share of a host's RAM; the process, its data pipeline and the OS need
# the rest (maxctx.train checks the host it runs on, maxctx.compile the host VM of the slice it compiles for).
HOST_MEMORY_SHARE = 0.8


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str
  kinds: tuple[str, ...]          # substrings of jax `Device.device_kind` that name this chip (case-insensitive)
  devices_per_chip: int           # JAX devices one chip presents
  bf16_tflops: float              # peak dense bf16 TFLOP/s per chip
  hbm_gb_s: float | None = None   # HBM bandwidth per chip, GB/s
  ici_gb_s: float | None = None   # inter-chip interconnect per chip, GB/s, both directions of all links together
  ici_links: int | None = None    # ICI links per chip (3-D torus: 6 neighbours; 2-D: 4)
  dcn_gbit_s: float | None = None  # data-center network per chip, Gbit/s
  # HBM per JAX device that programs may use, as libtpu reports it for a compile that runs out of memory ("available
  # HBM"): a little under the data-sheet figure (96 GiB per v5p chip, 192 GiB per v7 chip), the runtime reserves some.
  hbm_gib_per_device: float | None = None
  host_ram_gb: float | None = None   # RAM of one host VM, GB (what `remat: full_offload` fills)
  chips_per_host: int | None = None  # chips one host VM drives

  @property
  def host_ram_bytes(self) -> int | None:
    return None if self.host_ram_gb is None else int(self.host_ram_gb * 1e9)

  @property
  def tflops_per_device(self) -> float:
    return self.bf16_tflops / self.devices_per_chip

  @property
  def has_roofline(self) -> bool:
    """Whether every figure the roofline estimate needs is known."""
    return None not in (self.hbm_gb_s, self.ici_gb_s, self.ici_links)

  @property
  def link_gb_s(self) -> float:
    """One ICI link, one direction."""
    return self.ici_gb_s / 2 / self.ici_links


# Keyed by the GKE/XPK prefix for TPUs. Matching a device kind tries the rows in order, so v5e ("TPU v5 lite") stands
# before v5p ("TPU v5").
CHIPS: dict[str, Chip] = {
    "v5e": Chip("TPU v5e", ("TPU v5 lite", "TPU v5e"), 1, 197.0, hbm_gib_per_device=15.75),
    "v5p": Chip("TPU v5p", ("TPU v5p", "TPU v5"), 1, 459.0, 2765.0, 1200.0, 6, 50.0, 95.74, 448.0, 4),
    "tpu7x": Chip("TPU7x (Ironwood)", ("TPU7x", "TPU v7"), 2, 2307.0, 7380.0, 1200.0, 6, 100.0, 94.75, 960.0, 4),
    "v6e": Chip("TPU v6e (Trillium)", ("TPU v6 lite", "TPU v6e"), 1, 918.0, 1638.0, 800.0, 4, 100.0, 31.25, 720.0, 4),
    "v4": Chip("TPU v4", ("TPU v4",), 1, 275.0, hbm_gib_per_device=30.75),
    "h200": Chip("NVIDIA H200", ("H200",), 1, 989.0),
    "h100": Chip("NVIDIA H100", ("H100",), 1, 989.0),
    "b200": Chip("NVIDIA B200", ("B200",), 1, 2250.0),
    "a100": Chip("NVIDIA A100", ("A100",), 1, 312.0),
}


def for_device_kind(kind: str) -> Chip | None:
  """The chip whose `device_kind` this is, or None for one the table does not know (a CPU, a new accelerator)."""
  for chip in CHIPS.values():
    if any(k.lower() in kind.lower() for k in chip.kinds):
      return chip
  return None
