"""Logical axis names → mesh axes. The only module besides mesh.py that names physical axes.

Model code annotates arrays with logical names (`batch`, `seq`, `embed`, ...); this table says where they live.
Parameters and optimizer state are sharded over fsdp *and* context (ZeRO-3 across the CP group): at CP=128 an 8B
model replicated over the context axis would not fit. A dimension that an axis size does not divide is left
unsharded on that axis rather than padded.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Logical name → mesh axes, in order of preference.
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Activations: the batch over data and fsdp, the sequence over context, heads and the MLP over tensor.
    ("batch", ("data", "fsdp")), ("seq", ("context",)),
    ("act_heads", ("tensor",)), ("act_kv_heads", ("tensor",)), ("act_mlp", ("tensor",)), ("act_vocab", ("tensor",)),
    ("act_embed", ()), ("act_head_dim", ()), ("act_norm", ()), ("act_layers", ()),
    # Parameters: the model width over fsdp and context (ZeRO-3), the rest as their activations.
    ("embed", ("fsdp", "context")),
    ("vocab", ("tensor",)), ("heads", ("tensor",)), ("kv_heads", ("tensor",)), ("mlp", ("tensor",)),
    ("head_dim", ()), ("norm", ()), ("layers", ()),
)
_RULES = dict(RULES)

# The mesh axes that shard the batch, the sequence and the heads: the attention layer and data pipeline read these.
BATCH_AXES = _RULES["batch"]
SEQ_AXIS = _RULES["seq"][0]
HEAD_AXIS = _RULES["act_heads"][0]


def logical_to_spec(logical: Sequence[str | None], shape: Sequence[int], mesh_shape: dict[str, int]) -> P:
  """A PartitionSpec for an array of `shape` named `logical`, skipping axes that do not divide a dimension."""
  if len(logical) != len(shape):
    raise ValueError(f"logical axes {logical} do not match shape {shape}")
  used: set[str] = set()
  spec = []
  for name, dim in zip(logical, shape):
    axes = []
    size = 1
    for axis in _RULES.get(name, ()) if name else ():
      n = mesh_shape.get(axis, 1)
      if axis in used or n == 1 or dim % (size * n):
        continue
      axes.append(axis)
      size *= n
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return P(*spec)


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
  """with_sharding_constraint by logical names under the current mesh (`jax.set_mesh`); a no-op without one."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(logical, x.shape, dict(mesh.shape)))


def shards(logical: str) -> int:
  """How many ways the current mesh (`jax.set_mesh`) splits a dimension named `logical`; 1 without a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  n = 1
  for axis in _RULES.get(logical, ()):
    n *= dict(mesh.shape).get(axis, 1)
  return n


def tree_shardings(mesh: Mesh, abstract_tree: Any) -> Any:
  """NamedShardings for a tree of flax `LogicallyPartitioned` boxes (from `jax.eval_shape(init)`), unboxed."""

  def one(leaf):
    if isinstance(leaf, nn.LogicallyPartitioned):
      return NamedSharding(mesh, logical_to_spec(leaf.names, leaf.value.shape, dict(mesh.shape)))
    return NamedSharding(mesh, P())

  return jax.tree.map(one, abstract_tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Token arrays [B, T, ...]: batch over data×fsdp, sequence over context."""
  return NamedSharding(mesh, P(BATCH_AXES, SEQ_AXIS, *([None] * (ndim - 2))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
