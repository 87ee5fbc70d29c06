"""Context-parallel strategies by name. A strategy is an object that validates a configuration and builds the
attention function for a mesh; strategy names appear here and nowhere else."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Callable, ClassVar

import jax
from jax.sharding import Mesh, PartitionSpec as P

from maxctx import sharding
from maxctx.attention import kernels, layout
from maxctx.config import AttentionConfig
from maxctx.errors import ConfigError

# fn(q [B,T,N,H], k [B,T,K,H], v [B,T,K,H], segment_ids [B,T], positions [B,T]) -> out [B,T,N,H], global arrays.
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Problem:
  """What a strategy needs to know to accept or refuse a configuration, before anything compiles: the attention
  section as the user wrote it, and the shapes and degrees it will run at."""
  attention: AttentionConfig
  context: int          # CP degree: mesh context axis size (ICI × DCN)
  tensor: int           # tensor axis size (heads are sharded over it)
  n_heads: int
  n_kv_heads: int
  seq_len: int
  platform: str | None = None   # backend that will run it ("cpu", "gpu", "tpu"); None: the default backend
  head_dim: int | None = None   # None: not known (kernels that constrain it check it only when given)


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Bytes one device sends for attention, by collective kind, counted as maxctx.compile.hlo counts a compiled step's
  (an all-gather over G devices sends (G-1)x its operand, a reduce-scatter or all-to-all (G-1)/G of it, a ring hop its
  block): `forward` and `backward` of one layer, and `once` per step (the segment ids and positions every layer
  shares, which the compiler moves out of the layer loop)."""
  forward: dict[str, float]
  backward: dict[str, float]
  once: dict[str, float] = dataclasses.field(default_factory=dict)

  def step(self, n_layers: int, forward_runs: int = 1) -> dict[str, float]:
    """A step's bytes by kind: each layer's backward once and its forward `forward_runs` times (2 where remat runs
    the forward again inside the backward)."""
    out: dict[str, float] = {}
    for part, times in ((self.forward, n_layers * forward_runs), (self.backward, n_layers), (self.once, 1)):
      for kind, b in part.items():
        out[kind] = out.get(kind, 0.0) + times * b
    return out


def ids_bytes(rows: int, tokens: int) -> int:
  """Segment ids and positions (int32) of `rows` × `tokens`."""
  return 2 * rows * tokens * 4


class Strategy:
  name: ClassVar[str]
  uses_ulysses_degree: ClassVar[bool] = False

  def validate(self, p: Problem) -> None:
    """Raises ConfigError (one sentence) if this strategy cannot run `p`. Subclasses extend the shared checks."""
    a = p.attention
    if a.kernel not in kernels.KERNELS:
      close = difflib.get_close_matches(a.kernel, list(kernels.KERNELS), n=1)
      hint = f"did you mean {close[0]!r}?" if close else f"choose one of {', '.join(sorted(kernels.KERNELS))}."
      raise ConfigError(f"attention.kernel {a.kernel!r} is not a known kernel; {hint}")
    platforms = kernels.KERNELS[a.kernel].platforms
    platform = p.platform or jax.default_backend()
    if platforms is not None and platform not in platforms:
      raise ConfigError(f"attention.kernel {a.kernel!r} runs only on {' or '.join(platforms)}, not on {platform}; "
                        "use attention.kernel=blockwise there.")
    layout.check_length(p.seq_len, p.context, a.load_balance)   # before the kernel's checks, which divide by it
    if kernels.KERNELS[a.kernel].check is not None and (reason := kernels.KERNELS[a.kernel].check(p)):
      raise ConfigError(reason)
    if p.n_heads % p.n_kv_heads:
      raise ConfigError(f"model.n_heads {p.n_heads} is not a multiple of model.n_kv_heads {p.n_kv_heads}; "
                        "grouped-query attention needs each KV head to serve the same number of query heads.")
    for key, heads in (("model.n_heads", p.n_heads), ("model.n_kv_heads", p.n_kv_heads)):
      if heads % p.tensor:
        raise ConfigError(f"{key} {heads} is not divisible by the tensor degree {p.tensor} (mesh.ici.tensor × "
                          "mesh.dcn.tensor), over which attention shards its heads; choose a tensor degree that "
                          "divides both head counts.")
    if a.ulysses_degree is not None and not self.uses_ulysses_degree:
      raise ConfigError(f"attention.ulysses_degree={a.ulysses_degree} is read only by usp, not by {self.name}; "
                        "remove it or set attention.strategy=usp.")

  def build(self, mesh: Mesh, a: AttentionConfig) -> AttentionFn:
    """The attention function over `mesh` for the section `a` (which `validate` accepted)."""
    raise NotImplementedError

  def held_kv_bytes(self, p: Problem, rows: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of K/V and their gradients one device must hold at once in a layer's backward, from the shapes alone,
    for `rows` sequences per device: a bound below which no compile can go. 0 where the strategy holds only chunks
    of its own share (the compiled step's memory is then the measure)."""
    return 0

  def buffer_bytes(self, p: Problem, rows: int, head_dim: int, dtype_bytes: int) -> float:
    """Bytes of attention buffers one device holds at a layer's backward peak beyond its own q, k, v, output and
    their gradients, for `rows` sequences per device: the planner's estimate (maxctx.plan.cost_model, checked there
    against compiled steps), not a bound. 0 where the strategy works on its own share only."""
    return 0.0

  def traffic(self, p: Problem, rows: int, head_dim: int, dtype_bytes: int) -> Traffic | None:
    """The bytes one device sends for attention with `rows` sequences per device, from the shapes alone (gradients
    that the strategy accumulates in float32 travel as 4 bytes); None where the strategy does not model them."""
    return None

  @staticmethod
  def shard(mesh: Mesh, per_device: Callable) -> AttentionFn:
    """`per_device(q, k, v, segment_ids, positions)` on each device's block of the contract's global arrays."""
    tokens = P(sharding.BATCH_AXES, sharding.SEQ_AXIS)
    heads = P(sharding.BATCH_AXES, sharding.SEQ_AXIS, sharding.HEAD_AXIS, None)
    return jax.shard_map(per_device, mesh=mesh, in_specs=(heads, heads, heads, tokens, tokens), out_specs=heads,
                         check_vma=False)

  @staticmethod
  def require_chunked(p: Problem, name: str) -> None:
    if kernels.KERNELS[p.attention.kernel].parts is None:
      chunked = sorted(k for k, spec in kernels.KERNELS.items() if spec.parts is not None)
      raise ConfigError(f"attention.strategy {name} feeds the kernel one chunk of keys at a time, which "
                        f"attention.kernel {p.attention.kernel!r} cannot do; use one of {', '.join(chunked)}.")


STRATEGIES: dict[str, Strategy] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
  STRATEGIES[cls.name] = cls()
  return cls


# Not a strategy: `maxctx.train` and `maxctx.compile` replace it with the planner's choice before anything else reads
# the config.
AUTO = "auto"


def get(name: str) -> Strategy:
  if name == AUTO:
    raise ConfigError("attention.strategy auto is resolved only by maxctx.train, which measures the candidates on the "
                      "devices present, and by maxctx.compile, which plans for its TPU slice; elsewhere name a "
                      "strategy, e.g. from the recipe.yml of python -m maxctx.plan CONFIG.")
  if name not in STRATEGIES:
    close = difflib.get_close_matches(name, list(STRATEGIES), n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"choose one of {', '.join(sorted(STRATEGIES))}."
    raise ConfigError(f"attention.strategy {name!r} is not a known strategy; {hint}")
  return STRATEGIES[name]
