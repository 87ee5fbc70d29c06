"""Training data as global, sharded batches.

    pipeline = maxctx.data.build(config, mesh)
    batch = next(pipeline)   # {"tokens", "targets", "segment_ids", "positions"}: int32 [batch_size, seq_len]

Contract with the model: the loss counts token t iff segment_ids[t] != 0, and targets[t] is the token that follows
tokens[t] in its document. Arrays are sharded batch over data×fsdp and sequence over context; with
`attention.load_balance` every array is in zigzag layout (maxctx.attention.layout).
"""

from __future__ import annotations

from typing import Iterator

import jax
import numpy as np
from jax.sharding import Mesh

from maxctx import sharding
from maxctx.attention import layout
from maxctx.config import Config
from maxctx.data import synthetic
from maxctx.errors import ConfigError

FIELDS = ("tokens", "targets", "segment_ids", "positions")


def to_global(host_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Places a host batch on the mesh; each device receives only its own shard."""
  out = {}
  for k, v in host_batch.items():
    s = sharding.batch_sharding(mesh, v.ndim)
    out[k] = jax.make_array_from_callback(v.shape, s, lambda idx, v=v: v[idx])
  return out


class Pipeline(Iterator[dict[str, jax.Array]]):
  """Iterates global batches; `state()` / `restore(state)` make resuming exact."""

  def __init__(self, config: Config, mesh: Mesh):
    self._config, self._mesh = config, mesh
    self._context = mesh.shape[sharding.SEQ_AXIS]
    self._index = 0
    if config.data.source != "synthetic":
      raise ConfigError(f"data.source {config.data.source!r} is not available yet; use data.source=synthetic.")

  def host_batch(self, index: int) -> dict[str, np.ndarray]:
    d = self._config.data
    out = synthetic.batch(self._config.run.seed, index, d.batch_size, d.seq_len, self._config.model.vocab_size)
    if self._config.attention.load_balance:
      out = {k: layout.zigzag(v, self._context, axis=1) for k, v in out.items()}
    return out

  def __next__(self) -> dict[str, jax.Array]:
    batch = to_global(self.host_batch(self._index), self._mesh)
    self._index += 1
    return batch

  def state(self) -> dict:
    return {"index": self._index}

  def restore(self, state: dict) -> None:
    self._index = int(state["index"])


def build(config: Config, mesh: Mesh) -> Pipeline:
  return Pipeline(config, mesh)
