"""maxctx.sharding's logical → mesh mapping refuses what it cannot honour instead of replicating in silence, and the
user-caused cases are ConfigErrors naming the key before anything compiles."""

import pytest
from jax.sharding import PartitionSpec as P

from maxctx import config as config_lib, sharding, trainer
from maxctx.errors import ConfigError

MESH = {"data": 1, "fsdp": 2, "context": 4, "tensor": 2}


def test_spec_splits_each_name_over_its_axes_and_drops_axes_of_size_one():
  assert sharding.logical_to_spec(("batch", "seq", "act_embed"), (4, 64, 16), MESH) == P("fsdp", "context", None)
  assert sharding.logical_to_spec(("embed", "vocab"), (16, 8), MESH) == P(("fsdp", "context"), "tensor")
  assert sharding.logical_to_spec((None, "batch"), (3, 2), MESH) == P(None, "fsdp")


def test_a_dimension_its_axes_do_not_divide_is_an_error_not_a_replication():
  # Before, vocab 7 over tensor 2 (and width 12 over fsdp × context 8) came back unsharded on those axes: the whole
  # table on every device, which no memory estimate counted.
  with pytest.raises(ValueError, match=r"dimension 'vocab' of size 7 .* does not split over mesh axes \('tensor',\)"):
    sharding.logical_to_spec(("embed", "vocab"), (16, 7), MESH)
  with pytest.raises(ValueError, match=r"dimension 'embed' of size 12 .*\('fsdp', 'context'\), 8 ways"):
    sharding.logical_to_spec(("embed", "mlp"), (12, 8), MESH)


def test_two_names_on_one_mesh_axis_is_an_error():
  # `seq` and `embed` both want `context`; before, the second silently lost it.
  with pytest.raises(ValueError, match=r"logical axes 'seq' and 'embed' .* both map to mesh axis 'context'"):
    sharding.logical_to_spec(("seq", "embed"), (64, 16), MESH)


def test_an_unknown_name_is_an_error():
  with pytest.raises(ValueError, match=r"logical axis 'embedding' .* has no rule"):
    sharding.logical_to_spec(("embedding",), (16,), MESH)


@pytest.mark.parametrize("overrides, message", [
    (["mesh.ici.context=2", "mesh.ici.tensor=2", "model.vocab_size=511"],
     r"model.vocab_size 511 is not divisible by the 2 shards of the mesh \(tensor 2\)"),
    (["mesh.ici.context=2", "mesh.ici.tensor=2", "model.d_ff=341"],
     r"model.d_ff 341 is not divisible by the 2 shards of the mesh \(tensor 2\)"),
    (["model.d_model=132"], r"model.d_model 132 is not divisible by the 8 shards of the mesh \(fsdp 2 × context 4\)"),
])
def test_validate_names_the_model_key_the_mesh_does_not_divide(overrides, message):
  with pytest.raises(ConfigError, match=message) as err:
    trainer.validate(config_lib.load("configs/demo.yml", overrides), 8)   # demo: fsdp 2 × context 4
  assert str(err.value).count(". ") == 0
