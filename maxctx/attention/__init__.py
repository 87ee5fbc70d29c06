"""Context-parallel attention behind one entry point.

    fn = maxctx.attention.build(config.attention, mesh)   # the run's AttentionConfig
    out = fn(q, k, v, segment_ids, positions)

Inputs are global arrays: q [B, T, N, H], k and v [B, T, K, H], segment_ids and positions [B, T]; T is sharded over
the mesh's context axis, heads over tensor, B over data×fsdp. The mask is `mask.visible` (design.md, "The attention
contract"), so every strategy is exact under the zigzag layout.

Modules: registry (names → strategies, `Problem`, shared checks) · all_gather · ulysses (all-to-all, KV-head
replication) · ring (ppermute ring, custom_vjp) · usp (all-to-all in groups, ring across) · kernels (reference,
blockwise, flash, cudnn) · blockwise (online softmax pieces) · mask (the mask and the block-skip tests) · layout
(zigzag on the host).
"""

from __future__ import annotations

from jax.sharding import Mesh

# Importing a strategy's module registers it.
from maxctx.attention import all_gather as _all_gather  # noqa: F401
from maxctx.attention import ring as _ring  # noqa: F401
from maxctx.attention import ulysses as _ulysses  # noqa: F401
from maxctx.attention import usp as _usp  # noqa: F401
from maxctx.attention import kernels
from maxctx.attention.registry import AUTO, STRATEGIES, AttentionFn, Problem, Strategy, get
from maxctx.config import AttentionConfig


def validate(problem: Problem) -> None:
  """Raises ConfigError if the strategy `problem.attention` names cannot run `problem`."""
  get(problem.attention.strategy).validate(problem)


def build(config: AttentionConfig, mesh: Mesh) -> AttentionFn:
  """The attention function of `config.strategy` over `mesh`."""
  return get(config.strategy).build(mesh, config)


__all__ = ["AUTO", "AttentionConfig", "build", "validate", "get", "kernels", "Problem", "Strategy", "STRATEGIES",
           "AttentionFn"]
