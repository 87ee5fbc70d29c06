"""The device mesh: axes data, fsdp, context, tensor; ICI sizes inside a slice times DCN sizes across slices."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from maxctx import config as config_lib
from maxctx.config import MESH_AXES, MeshConfig
from maxctx.errors import ConfigError


def _sizes(axes, name: str) -> dict[str, int]:
  config_lib.check(axes, f"mesh.{name}.")   # each size on its own, as the schema says
  return {a: getattr(axes, a) for a in MESH_AXES}


def resolve_axes(mesh_cfg: MeshConfig, num_devices: int, num_slices: int = 1) -> tuple[dict[str, int], dict[str, int]]:
  """Returns (ici, dcn) axis sizes with the one -1 filled in; raises ConfigError if they cannot cover the devices."""
  ici, dcn = _sizes(mesh_cfg.ici, "ici"), _sizes(mesh_cfg.dcn, "dcn")
  if any(s == -1 for s in dcn.values()):
    raise ConfigError("mesh.dcn sizes cannot be -1; set them to the number of slices along each axis.")
  dcn_product = math.prod(dcn.values())
  if dcn_product != num_slices:
    raise ConfigError(f"mesh.dcn sizes multiply to {dcn_product} but the job has {num_slices} slice(s); "
                      "make the product of mesh.dcn.* equal the slice count.")
  per_slice = num_devices // num_slices
  inferred = [a for a, s in ici.items() if s == -1]
  if len(inferred) > 1:
    raise ConfigError(f"mesh.ici has -1 on {', '.join(inferred)}; at most one axis can be inferred.")
  known = math.prod(s for s in ici.values() if s != -1)
  if inferred:
    if per_slice % known:
      raise ConfigError(f"mesh.ici sizes multiply to {known}, which does not divide the {per_slice} devices per slice, "
                        f"so mesh.ici.{inferred[0]}=-1 cannot be inferred; choose sizes whose product divides "
                        f"{per_slice}.")
    ici[inferred[0]] = per_slice // known
  product = math.prod(ici.values())
  if product != per_slice:
    raise ConfigError(f"mesh.ici sizes multiply to {product} but there are {per_slice} devices per slice; "
                      f"make the product equal {per_slice} or set one axis to -1.")
  return ici, dcn


def axis_sizes(mesh_cfg: MeshConfig, num_devices: int, num_slices: int = 1) -> dict[str, int]:
  """The total size of each axis (ICI × DCN)."""
  ici, dcn = resolve_axes(mesh_cfg, num_devices, num_slices)
  return {a: ici[a] * dcn[a] for a in MESH_AXES}


def num_slices_of(devices: Sequence[jax.Device]) -> int:
  return len({getattr(d, "slice_index", 0) for d in devices})


def build_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A Mesh over `devices` (default: all) with a physical layout that keeps the inner axes on fast links."""
  devices = list(jax.devices() if devices is None else devices)
  slices = num_slices_of(devices)
  ici, dcn = resolve_axes(mesh_cfg, len(devices), slices)
  ici_shape = [ici[a] for a in MESH_AXES]
  dcn_shape = [dcn[a] for a in MESH_AXES]
  if slices > 1:
    device_array = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices, allow_split_physical_axes=True)
  else:
    try:
      device_array = mesh_utils.create_device_mesh(ici_shape, devices, allow_split_physical_axes=True)
    except (NotImplementedError, ValueError, AssertionError):
      # Topologies mesh_utils has no layout for (odd CPU/GPU counts): plain order is as good as any.
      device_array = np.asarray(devices).reshape(ici_shape)
  return Mesh(device_array, MESH_AXES)
