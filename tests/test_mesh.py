"""The mesh covers exactly the devices, infers one -1 axis, and says what is wrong when it cannot."""

import jax
import pytest

from maxctx import config, mesh
from maxctx.errors import ConfigError


def _mesh_cfg(**ici):
  overrides = [f"mesh.ici.{k}={v}" for k, v in ici.items()]
  return config.load(None, ["model.preset=tiny", "mesh.ici.fsdp=1"] + overrides).mesh


@pytest.mark.parametrize("ici, expect", [
    ({"context": 8}, {"data": 1, "fsdp": 1, "context": 8, "tensor": 1}),
    ({"fsdp": 2, "context": 4}, {"data": 1, "fsdp": 2, "context": 4, "tensor": 1}),
    ({"data": 2, "context": 2, "tensor": 2}, {"data": 2, "fsdp": 1, "context": 2, "tensor": 2}),
    ({"fsdp": -1, "context": 2}, {"data": 1, "fsdp": 4, "context": 2, "tensor": 1}),
])
def test_build_mesh_shapes(ici, expect):
  m = mesh.build_mesh(_mesh_cfg(**ici))
  assert dict(m.shape) == expect
  assert m.devices.size == jax.device_count() == 8


def test_product_mismatch_names_both_numbers():
  with pytest.raises(ConfigError) as e:
    mesh.build_mesh(_mesh_cfg(context=4))
  assert "multiply to 4" in str(e.value) and "8 devices" in str(e.value)


def test_two_inferred_axes_are_refused():
  with pytest.raises(ConfigError, match="at most one axis"):
    mesh.build_mesh(_mesh_cfg(fsdp=-1, context=-1))


def test_inference_that_cannot_divide_is_refused():
  with pytest.raises(ConfigError, match="does not divide"):
    mesh.build_mesh(_mesh_cfg(fsdp=-1, context=3))


def test_dcn_must_match_slices():
  c = config.load(None, ["mesh.dcn.data=2"])
  with pytest.raises(ConfigError, match="slice"):
    mesh.build_mesh(c.mesh)
