"""What the planner tries: a candidate is a strategy, its context (and ulysses) degree, a remat policy and an MLP
chunk, with the config `maxctx.trainer.validate` checked (or its refusal); `candidates` lists every one for a length.
maxctx.plan measures or estimates them, maxctx.plan_auto resolves `auto` with them."""

from __future__ import annotations

import dataclasses
import itertools
import typing
from typing import Any

from maxctx import mesh as mesh_lib
from maxctx.bench import plan as cases_lib
from maxctx.config import MESH_AXES, Config, ModelConfig

AUTO = "auto"   # model.remat: auto asks the planner to try every policy
REMATS = tuple(r for r in typing.get_args(typing.get_type_hints(ModelConfig)["remat"]) if r != AUTO)   # the policies


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One way to run the same training: a strategy, its context (and ulysses) degree, a remat policy, an MLP chunk."""
  strategy: str                   # a registered strategy, or `none`
  context: int
  ulysses: int | None
  remat: str
  mlp_chunk: int                  # model.mlp_chunk: tokens per MLP step, 0 = all of the device's at once
  case: cases_lib.Case            # the validated config (or the refusal) at one length

  @property
  def label(self) -> str:
    u = f" u={self.ulysses}" if self.ulysses else ""
    chunk = f" mlp_chunk={self.mlp_chunk}" if self.mlp_chunk else ""
    return f"{self.strategy} c={self.context}{u} remat={self.remat}{chunk}"

  @property
  def overrides(self) -> dict[str, Any]:
    """The run-file keys this candidate sets: strategy, ulysses degree, the mesh's ICI and DCN sizes, remat, MLP
    chunk."""
    c = self.case.config
    out: dict[str, Any] = {"attention.strategy": c.attention.strategy,
                           "attention.ulysses_degree": c.attention.ulysses_degree, "model.remat": c.model.remat,
                           "model.mlp_chunk": c.model.mlp_chunk}
    for level in ("ici", "dcn"):
      out.update({f"mesh.{level}.{a}": getattr(getattr(c.mesh, level), a) for a in MESH_AXES})
    return out


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


# The MLP chunk a plan tries besides the run's own: [16,384, d_ff] buffers (448 MiB each in bfloat16 at d_ff 14,336)
# in place of [tokens per device, d_ff] ones, in rows long enough to keep the MXU's tiles full.
MLP_CHUNK = 16384


def mlp_chunks(wanted: list[int], local: int) -> list[int]:
  """The MLP chunks of `wanted` that differ for `local` tokens per device, as they run: one that does not split them
  (≥ local) runs the MLP unchunked, so it is tried once, as 0."""
  return list(dict.fromkeys(c if 0 < c < local else 0 for c in wanted))


def candidates(base: Config, strategies: list[str], seq_len: int, remats: list[str], num_devices: int,
               num_slices: int = 1, steps: int | None = None, platform: str | None = None,
               chunks: list[int] | None = None) -> list[Candidate]:
  """Every candidate at `seq_len`, valid or refused, in a fixed order (strategy, context, ulysses, remat, MLP chunk);
  `chunks` are the model.mlp_chunk values to try (default: the run's)."""
  chunks = [base.model.mlp_chunk] if chunks is None else chunks
  if base.mesh.ici.data > 0 and base.mesh.ici.tensor > 0:
    # Only data and tensor are kept from the run file: its fsdp × context may be for another number of devices.
    base = base.replace(**{"mesh.ici.fsdp": -1, "mesh.ici.context": 1})
  ici, dcn = mesh_lib.resolve_axes(base.mesh, num_devices, num_slices)
  free = ici["fsdp"] * ici["context"]   # the ICI devices that context and fsdp share
  out = []
  for strategy in strategies:
    degrees = [1] if strategy == cases_lib.NONE else [d for d in _divisors(free) if d > 1]
    for context in degrees:
      ulysses = [u for u in _divisors(context) if 1 < u < context] if strategy == "usp" else [None]
      # `none` puts the DCN context on fsdp too (cases_lib.configure): its one sequence is whole on each device.
      total = 1 if strategy == cases_lib.NONE else context * dcn["context"]
      for u in ulysses:
        for remat, chunk in itertools.product(remats, mlp_chunks(chunks, seq_len // total)):
          config = base.replace(**{"model.remat": remat, "model.mlp_chunk": chunk, "attention.ulysses_degree": u,
                                   "mesh.ici.context": context, "mesh.ici.fsdp": free // context})
          case = cases_lib.configure(config, strategy, seq_len, num_devices, num_slices, steps=steps,
                                     platform=platform)
          out.append(Candidate(strategy, total, u, remat, chunk, case))
  return out
