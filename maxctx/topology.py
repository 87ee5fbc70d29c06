"""TPU slice names as GKE and XPK write them (`v5p-128`, `tpu7x-128`, `v6e-256`), resolved to what libtpu and the
launcher need: the physical topology (`4x4x4`), chips, JAX devices, and HBM per device.

The number in a name counts TensorCores for v4, v5p and v7 (two per chip) and chips for v5e and v6e, so `v5p-128`
and `tpu7x-128` are both 64 chips; a v5p chip is one JAX device (megacore) while a v7 chip is two.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re

from maxctx import chips as chips_lib
from maxctx.errors import ConfigError

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Generation:
  prefix: str             # the GKE/XPK name prefix: v5p, tpu7x, ...
  libtpu: str             # the name libtpu's topology descriptions use
  cores_per_chip: int     # what the number in `<prefix>-N` counts per chip
  dims: int               # 3-D torus (v4, v5p, v7) or 2-D (v5e, v6e)
  device_kind: str        # jax.Device.device_kind on this generation

  @property
  def chip(self) -> chips_lib.Chip:
    return chips_lib.CHIPS[self.prefix]

  @property
  def devices_per_chip(self) -> int:
    return self.chip.devices_per_chip


# The chips' figures (peak FLOP/s, HBM, devices per chip) are maxctx/chips.py's.
GENERATIONS: dict[str, Generation] = {g.prefix: g for g in (
    Generation("v5p", "v5p", 2, 3, "TPU v5"),
    Generation("tpu7x", "tpu7x", 2, 3, "TPU7x"),
    Generation("v4", "v4", 2, 3, "TPU v4"),
    Generation("v5e", "v5e", 1, 2, "TPU v5 lite"),
    Generation("v6e", "v6e", 1, 2, "TPU v6 lite"),
)}
# XPK also accepts these spellings.
ALIASES = {"v5litepod": "v5e", "v6": "v6e", "v7x": "tpu7x", "tpu-v7": "tpu7x"}


@dataclasses.dataclass(frozen=True)
class Topology:
  name: str               # the GKE/XPK name, e.g. tpu7x-128
  generation: Generation
  shape: tuple[int, ...]  # chips along each torus axis

  @property
  def chips(self) -> int:
    return math.prod(self.shape)

  @property
  def devices(self) -> int:
    return self.chips * self.generation.devices_per_chip

  @property
  def libtpu_name(self) -> str:
    """What `jax.experimental.topologies.get_topology_desc(topology_name=...)` takes, e.g. tpu7x:4x4x4."""
    return f"{self.generation.libtpu}:{self.shape_text}"

  @property
  def shape_text(self) -> str:
    """The physical topology as GKE's `cloud.google.com/gke-tpu-topology` label writes it, e.g. 4x4x4."""
    return "x".join(map(str, self.shape))

  @property
  def hbm_bytes(self) -> int:
    return int(self.generation.chip.hbm_gib_per_device * GIB)

  @property
  def devices_per_host(self) -> int | None:
    """JAX devices one host VM drives (all of them in a slice smaller than a VM), or None where unknown."""
    per_host = self.generation.chip.chips_per_host
    return None if per_host is None else min(per_host, self.chips) * self.generation.devices_per_chip


def default_shape(chips: int, dims: int) -> tuple[int, ...]:
  """The shape GKE gives a slice of `chips` chips: start from the smallest slice and double the last of the shortest
  axes (v5p: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ...; v6e: 1x1, 1x2, 2x2, 2x4, 4x4, ...)."""
  shape = [2, 2, 1] if dims == 3 else [1, 1]
  if chips < math.prod(shape) or chips & (chips - 1):
    return ()
  while math.prod(shape) < chips:
    smallest = min(shape)
    last = max(i for i, s in enumerate(shape) if s == smallest)
    shape[last] *= 2
  return tuple(shape)


def _generation(prefix: str, name: str) -> Generation:
  prefix = ALIASES.get(prefix, prefix)
  if prefix not in GENERATIONS:
    close = difflib.get_close_matches(prefix, list(GENERATIONS) + list(ALIASES), n=1)
    hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(GENERATIONS)}."
    raise ConfigError(f"TPU type {name!r} names an unknown TPU generation {prefix!r}; {hint}")
  return GENERATIONS[prefix]


def resolve(name: str) -> Topology:
  """`v5p-128` (GKE/XPK) or `v5p:4x4x4` (libtpu) → Topology; ConfigError for anything else."""
  name = name.strip()
  if m := re.fullmatch(r"([a-z0-9-]+?)-(\d+)", name):
    gen = _generation(m.group(1), name)
    count = int(m.group(2))
    if count % gen.cores_per_chip:
      raise ConfigError(f"TPU type {name!r} is not a whole number of chips ({gen.prefix} counts {gen.cores_per_chip} "
                        f"per chip); use a multiple of {gen.cores_per_chip}, e.g. {gen.prefix}-128.")
    shape = default_shape(count // gen.cores_per_chip, gen.dims)
    if not shape:
      smallest = default_shape(4 if gen.dims == 3 else 1, gen.dims)
      least = math.prod(smallest) * gen.cores_per_chip
      raise ConfigError(f"TPU type {name!r} has no standard slice shape; use a power of two of at least {least} "
                        f"({gen.prefix}-{least}, ...) or name the shape, e.g. "
                        f"{gen.prefix}:{'x'.join(map(str, smallest))}.")
    return Topology(name, gen, shape)
  if m := re.fullmatch(r"([a-z0-9-]+):(\d+(?:x\d+)+)", name):
    gen = _generation(m.group(1), name)
    shape = tuple(int(s) for s in m.group(2).split("x"))
    if len(shape) != gen.dims:
      raise ConfigError(f"TPU topology {name!r} has {len(shape)} axes but {gen.prefix} slices have {gen.dims}; "
                        f"write e.g. {gen.prefix}:{'x'.join(['2'] * gen.dims)}.")
    return Topology(f"{gen.prefix}-{math.prod(shape) * gen.cores_per_chip}", gen, shape)
  raise ConfigError(f"TPU type {name!r} is not of the form <generation>-<cores> (e.g. tpu7x-128, v5p-128) or "
                    "<generation>:<shape> (e.g. v5p:4x4x4).")
