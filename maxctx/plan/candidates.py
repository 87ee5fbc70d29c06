"""What the planner tries: a candidate is a strategy, its context (and ulysses) degree, a remat policy (with its layer
groups), an MLP chunk and (where the plan varies it) a loss chunk, with the config `maxctx.trainer.validate` checked
(or its refusal); `candidates` lists every one for a length, and `remat_flag`, `remat_group_flag`, `mlp_chunk_flag`
and `loss_chunk_flag` read maxctx.plan's flags. maxctx.plan.measured and .estimated measure or estimate them,
maxctx.plan.auto resolves `auto` with them."""

from __future__ import annotations

import dataclasses
import itertools
import typing
from typing import Any

from maxctx import mesh as mesh_lib
from maxctx.bench import cases as cases_lib
from maxctx.config import MESH_AXES, Config, ModelConfig
from maxctx.errors import ConfigError
from maxctx.model.transformer import GROUPED_REMATS

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
  loss_chunk: int | None = None   # model.loss_chunk where the plan varies it (in the label); None: the run's
  remat_group: int = 1            # model.remat_group: layers per saved input (nested remat)

  @property
  def label(self) -> str:
    u = f" u={self.ulysses}" if self.ulysses else ""
    chunk = f" mlp_chunk={self.mlp_chunk}" if self.mlp_chunk else ""
    loss = "" if self.loss_chunk is None else f" loss_chunk={self.loss_chunk}"
    return f"{self.strategy} c={self.context}{u} {self.remat_label}{chunk}{loss}"

  @property
  def policy(self) -> tuple[str, int]:
    """(remat, remat group): what decides what each layer saves."""
    return self.remat, self.remat_group

  @property
  def remat_label(self) -> str:
    return f"remat={self.remat}" + (f" remat_group={self.remat_group}" if self.remat_group > 1 else "")

  @property
  def overrides(self) -> dict[str, Any]:
    """The run-file keys this candidate sets: strategy, ulysses degree, the mesh's ICI and DCN sizes, remat, MLP
    chunk and loss chunk."""
    c = self.case.config
    out: dict[str, Any] = {"attention.strategy": c.attention.strategy,
                           "attention.ulysses_degree": c.attention.ulysses_degree, "model.remat": c.model.remat,
                           "model.remat_group": c.model.remat_group, "model.mlp_chunk": c.model.mlp_chunk,
                           "model.loss_chunk": c.model.loss_chunk}
    for level in ("ici", "dcn"):
      out.update({f"mesh.{level}.{a}": getattr(getattr(c.mesh, level), a) for a in MESH_AXES})
    return out


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


# The MLP chunk a plan tries besides the run's own: [16,384, d_ff] buffers (448 MiB each in bfloat16 at d_ff 14,336)
# in place of [tokens per device, d_ff] ones, in rows long enough to keep the MXU's tiles full.
MLP_CHUNK = 16384


def mlp_chunks_for(wanted: list[int], local: int) -> list[int]:
  """The MLP chunks of `wanted` that differ for `local` tokens per device, as they run: one that does not split them
  (≥ local) runs the MLP unchunked, so it is tried once, as 0."""
  return list(dict.fromkeys(c if 0 < c < local else 0 for c in wanted))


def loss_chunks_for(wanted: list[int], local: int) -> list[int]:
  """The loss chunks of `wanted` that differ for `local` tokens per device: the loss always runs in steps, and one
  of `local` tokens or more is a single step of all of them, tried once, as `local`."""
  return list(dict.fromkeys(min(c, local) for c in wanted))


def remats_with_groups(remats: list[str], groups: list[int]) -> list[tuple[str, int]]:
  """(policy, model.remat_group) pairs: every group of `groups` under the policies that save only layer inputs (full,
  full_offload; one that does not divide the layers is refused with validate's sentence), 1 under the others."""
  return list(dict.fromkeys((r, g if r in GROUPED_REMATS else 1) for r in remats for g in groups))


def candidates(base: Config, strategies: list[str], seq_len: int, remats: list[str], num_devices: int,
               num_slices: int = 1, steps: int | None = None, platform: str | None = None,
               chunks: list[int] | None = None, loss_chunks: list[int] | None = None,
               groups: list[int] | None = None) -> list[Candidate]:
  """Every candidate at `seq_len`, valid or refused, in a fixed order (strategy, context, ulysses, remat, remat group,
  MLP chunk, loss chunk); `chunks` are the model.mlp_chunk values to try (default: the run's), `loss_chunks` the
  model.loss_chunk values (default: the run's, and then not in the candidates' labels), `groups` the
  model.remat_group values (default: the run's)."""
  chunks = [base.model.mlp_chunk] if chunks is None else chunks
  pairs = remats_with_groups(remats, [base.model.remat_group] if groups is None else groups)
  varied = loss_chunks is not None
  wanted_losses = [base.model.loss_chunk] if loss_chunks is None else loss_chunks
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
        local = seq_len // total
        for (remat, group), chunk, loss in itertools.product(
            pairs, mlp_chunks_for(chunks, local), loss_chunks_for(wanted_losses, local) if varied else wanted_losses):
          config = base.replace(**{"model.remat": remat, "model.remat_group": group, "model.mlp_chunk": chunk,
                                   "model.loss_chunk": loss,
                                   "attention.ulysses_degree": u, "mesh.ici.context": context,
                                   "mesh.ici.fsdp": free // context})
          case = cases_lib.configure(config, strategy, seq_len, num_devices, num_slices, steps=steps,
                                     platform=platform)
          out.append(Candidate(strategy, total, u, remat, chunk, case, loss if varied else None, group))
  return out


# What maxctx.plan's flags ask to try.

def remat_flag(text: str | None, config: Config) -> list[str]:
  """--remat: policies, `auto` for all of them (default: the run's)."""
  names = [s.strip() for s in (text or config.model.remat).split(",") if s.strip()]
  names = [r for name in names for r in (REMATS if name == AUTO else [name])]
  for name in names:
    if name not in REMATS:
      raise ConfigError(f"--remat has {name!r}, which is not a remat policy; choose from {', '.join(REMATS)}.")
  if not names:
    raise ConfigError(f"--remat is empty; name at least one of {', '.join(REMATS)}.")
  return list(dict.fromkeys(names))


def remat_group_flag(text: str | None, config: Config, topology: bool) -> list[int]:
  """--remat-group (default: the run's; in topology mode also 1 and REMAT_GROUP, which only a length that fits no
  other way needs: it costs a third forward)."""
  if text is None:
    return list(dict.fromkeys([config.model.remat_group] + ([1, REMAT_GROUP] if topology else [])))
  try:
    values = [int(s) for s in text.split(",") if s.strip()]
  except ValueError:
    values = [0]
  if not values or min(values) < 1:
    raise ConfigError(f"--remat-group is {text!r}; give comma-separated layer counts of at least 1 (layers per saved "
                      "input, e.g. 1,2).")
  return list(dict.fromkeys(values))


# The remat group a topology plan tries besides the run's own: half the saved inputs, for one more forward.
REMAT_GROUP = 2


def mlp_chunk_flag(text: str | None, config: Config) -> list[int]:
  """--mlp-chunk (default: the run's and MLP_CHUNK)."""
  if text is None:
    return list(dict.fromkeys([config.model.mlp_chunk, MLP_CHUNK]))
  return _token_counts(text, "--mlp-chunk", f"of at least 0, 0 for the MLP unchunked (e.g. 0,{MLP_CHUNK})")


def loss_chunk_flag(text: str | None) -> list[int] | None:
  """--loss-chunk (default None: the run's, not varied)."""
  if text is None:
    return None
  return _token_counts(text, "--loss-chunk", "of at least 1 (e.g. 1024,2048; one of a device's tokens or more is "
                       "the loss in one step)", least=1)


def _token_counts(text: str, flag: str, example: str, least: int = 0) -> list[int]:
  try:
    values = [int(s) for s in text.split(",") if s.strip()]
  except ValueError:
    values = [least - 1]
  if not values or min(values) < least:
    raise ConfigError(f"{flag} is {text!r}; give comma-separated token counts {example}.")
  return list(dict.fromkeys(values))
