"""Context-parallel strategies by name. A strategy is an object that validates a configuration and builds the
attention function for a mesh; strategy names appear here and nowhere else."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Callable, ClassVar

import jax
from jax.sharding import Mesh

from maxctx.attention import kernels
from maxctx.errors import ConfigError

# fn(q [B,T,N,H], k [B,T,K,H], v [B,T,K,H], segment_ids [B,T], positions [B,T]) -> out [B,T,N,H], global arrays.
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Problem:
  """What a strategy needs to know to accept or refuse a configuration, before anything compiles."""
  context: int          # CP degree: mesh context axis size (ICI × DCN)
  tensor: int           # tensor axis size (heads are sharded over it)
  n_heads: int
  n_kv_heads: int
  seq_len: int
  kernel: str
  load_balance: bool = False
  ulysses_degree: int | None = None
  block_q: int | None = None
  block_kv: int | None = None


class Strategy:
  name: ClassVar[str]

  def validate(self, p: Problem) -> None:
    """Raises ConfigError (one sentence) if this strategy cannot run `p`. Subclasses extend the shared checks."""
    if p.kernel not in kernels.KERNELS:
      close = difflib.get_close_matches(p.kernel, list(kernels.KERNELS), n=1)
      hint = f"did you mean {close[0]!r}?" if close else f"choose one of {', '.join(sorted(kernels.KERNELS))}."
      raise ConfigError(f"attention.kernel {p.kernel!r} is not a known kernel; {hint}")
    chunks = 2 * p.context if p.load_balance else p.context
    if p.seq_len % chunks:
      what = f"2 × context = {chunks} (zigzag load balancing)" if p.load_balance else f"the context degree {chunks}"
      raise ConfigError(f"data.seq_len {p.seq_len} is not divisible by {what}; choose a multiple of {chunks}.")

  def build(self, mesh: Mesh, *, kernel: str, load_balance: bool, ulysses_degree: int | None,
            block_q: int | None, block_kv: int | None) -> AttentionFn:
    raise NotImplementedError


STRATEGIES: dict[str, Strategy] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
  STRATEGIES[cls.name] = cls()
  return cls


def get(name: str) -> Strategy:
  if name not in STRATEGIES:
    close = difflib.get_close_matches(name, list(STRATEGIES), n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"choose one of {', '.join(sorted(STRATEGIES))}."
    raise ConfigError(f"attention.strategy {name!r} is not a known strategy; {hint}")
  return STRATEGIES[name]
