"""Context-parallel attention behind one entry point.

    fn = maxctx.attention.build("ring", mesh, kernel="blockwise", load_balance=True)
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


def validate(strategy: str, problem: Problem) -> None:
  """Raises ConfigError if `strategy` cannot run `problem`."""
  get(strategy).validate(problem)


def build(strategy: str, mesh: Mesh, *, kernel: str = "blockwise", load_balance: bool = False,
          ulysses_degree: int | None = None, block_q: int | None = None, block_kv: int | None = None) -> AttentionFn:
  """The attention function of `strategy` over `mesh`."""
  return get(strategy).build(mesh, kernel=kernel, load_balance=load_balance, ulysses_degree=ulysses_degree,
                             block_q=block_q, block_kv=block_kv)


__all__ = ["AUTO", "build", "validate", "get", "kernels", "Problem", "Strategy", "STRATEGIES", "AttentionFn"]
