"""Logical axis names → mesh axes. The only module besides mesh.py that names physical axes.

Model code annotates arrays with logical names (`batch`, `seq`, `embed`, ...); this table says where they live.
Parameters and optimizer state are sharded over fsdp *and* context (ZeRO-3 across the CP group): at CP=128 an 8B
model replicated over the context axis would not fit. A dimension that its axes do not divide is an error, not a
silent replication (logical_to_spec).
"""

from __future__ import annotations

import math
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
  """A PartitionSpec for an array of `shape` named `logical` (None: not sharded). Raises ValueError where a name is
  not in RULES, where two names would shard over one mesh axis, or where a dimension does not split evenly over its
  axes: replicating such a dimension instead would cost memory no plan counted. What a user's config can cause
  (a model dimension the mesh does not divide) is refused earlier, with the key to change (maxctx.trainer.validate);
  a caller that wants a dimension replicated names it None."""
  if len(logical) != len(shape):
    raise ValueError(f"logical axes {logical} do not match shape {shape}")
  used: dict[str, str] = {}
  spec = []
  for name, dim in zip(logical, shape):
    if name is not None and name not in _RULES:
      raise ValueError(f"logical axis {name!r} (of an array {tuple(shape)}) has no rule in maxctx.sharding.RULES")
    axes = tuple(a for a in _RULES.get(name, ()) if mesh_shape.get(a, 1) > 1) if name else ()   # size 1: no split
    for axis in axes:
      if axis in used:
        raise ValueError(f"logical axes {used[axis]!r} and {name!r} of {tuple(logical)} both map to mesh axis "
                         f"{axis!r}; an array can be split over a mesh axis only once")
      used[axis] = name
    ways = math.prod(mesh_shape[a] for a in axes)
    if dim % ways:
      raise ValueError(f"dimension {name!r} of size {dim} (array {tuple(shape)}, axes {tuple(logical)}) does not split "
                       f"over mesh axes {axes}, {ways} ways")
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*spec)


def ways(logical: str, mesh_shape: dict[str, int]) -> int:
  """How many ways a dimension named `logical` is split on a mesh of `mesh_shape` (axis name → size)."""
  return math.prod(mesh_shape.get(axis, 1) for axis in _RULES[logical])


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
  """with_sharding_constraint by logical names under the current mesh (`jax.set_mesh`); a no-op without one."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(logical, x.shape, dict(mesh.shape)))


def shards(logical: str) -> int:
  """How many ways the current mesh (`jax.set_mesh`) splits a dimension named `logical`; 1 without a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else ways(logical, dict(mesh.shape))


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
