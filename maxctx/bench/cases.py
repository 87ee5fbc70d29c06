"""Which runs a benchmark makes: one config per strategy × sequence length, all from the same base config.

Every run trains the same model (same parameters from the same seed) on the same data (same source, seed and global
batch) on the same devices; only the attention strategy, the sequence length and the mesh differ. CP strategies use
the base config's context degree (or `--context`), with the remaining devices on fsdp/data as the base config says.
`none` is no context parallelism: the context devices move to fsdp, so each sequence sits whole on one device of its
data group (and needs a global batch of at least the devices' count). A combination a strategy cannot run is refused
with the one-sentence ConfigError that `maxctx.trainer.validate` gives, and the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import difflib

from maxctx import attention
from maxctx import mesh as mesh_lib
from maxctx import trainer as trainer_lib
from maxctx.config import Config
from maxctx.errors import ConfigError
from maxctx.lengths import parse_lengths

NONE = "none"
DEFAULT_STRATEGIES = "none,all_gather,ulysses,ring,usp"
# What `none` runs on its single-device sequences: all-gather over a context axis of one device moves nothing.
NONE_STRATEGY = "all_gather"


@dataclasses.dataclass(frozen=True)
class Case:
  strategy: str              # a registered strategy, or `none`
  seq_len: int
  config: Config | None      # None when refused
  refused: str | None = None  # the ConfigError sentence

  @property
  def name(self) -> str:
    return f"{self.strategy}-{tokens(self.seq_len)}"


def tokens(n: int) -> str:
  """14680064 → 14m, 4096 → 4k, 1536 → 1536."""
  for unit, size in (("m", 1 << 20), ("k", 1 << 10)):
    if n >= size and n % size == 0:
      return f"{n // size}{unit}"
  return str(n)


def parse_strategies(text: str) -> list[str]:
  names = [s.strip() for s in text.split(",") if s.strip()]
  if not names:
    raise ConfigError("--strategies is empty; name at least one of none, " + ", ".join(sorted(attention.STRATEGIES))
                      + ".")
  known = [NONE, *sorted(attention.STRATEGIES)]
  for name in names:
    if name not in known:
      close = difflib.get_close_matches(name, known, n=1)
      hint = f"did you mean {close[0]}?" if close else f"choose from {', '.join(known)}."
      raise ConfigError(f"--strategies has {name!r}, which is not a strategy; {hint}")
  return list(dict.fromkeys(names))


def lengths(text: str) -> list[int]:
  return list(dict.fromkeys(parse_lengths(text, "--lengths")))


def _mesh_overrides(base: Config, strategy: str, num_devices: int, num_slices: int,
                    context: int | None) -> dict[str, int]:
  """Explicit mesh sizes for `strategy`: the base mesh (with `--context` applied), or for `none` its context on fsdp."""
  if context is not None:
    # The CP degree from --context, the rest of each slice on fsdp (inferred).
    base = base.replace(**{"mesh.ici.context": context, "mesh.ici.fsdp": -1})
  ici, dcn = mesh_lib.resolve_axes(base.mesh, num_devices, num_slices)
  if strategy == NONE:
    ici["fsdp"], ici["context"] = ici["fsdp"] * ici["context"], 1
    dcn["fsdp"], dcn["context"] = dcn["fsdp"] * dcn["context"], 1
  out = {f"mesh.ici.{a}": s for a, s in ici.items()}
  out.update({f"mesh.dcn.{a}": s for a, s in dcn.items()})
  return out


def configure(base: Config, strategy: str, seq_len: int, num_devices: int, num_slices: int = 1,
              context: int | None = None, steps: int | None = None, platform: str | None = None) -> Case:
  """The config of one run, checked by `maxctx.trainer.validate`."""
  overrides = {"attention.strategy": NONE_STRATEGY if strategy == NONE else strategy, "data.seq_len": seq_len,
               "run.name": f"{base.run.name}-bench-{strategy}-{tokens(seq_len)}", "checkpoint.every_steps": 0,
               "checkpoint.load_params": "", "eval.every_steps": 0}
  if not attention.get(overrides["attention.strategy"]).uses_ulysses_degree:
    overrides["attention.ulysses_degree"] = None  # the strategies that do not read it refuse it
  if steps is not None:
    overrides["run.steps"] = steps
  try:
    overrides.update(_mesh_overrides(base, strategy, num_devices, num_slices, context))
    config = base.replace(**overrides)
    trainer_lib.validate(config, num_devices, num_slices, platform=platform)
  except ConfigError as e:
    return Case(strategy, seq_len, None, str(e))
  return Case(strategy, seq_len, config)


def plan(base: Config, strategies: list[str], seq_lens: list[int], num_devices: int, num_slices: int = 1,
         context: int | None = None, steps: int | None = None, platform: str | None = None) -> list[Case]:
  """Every (strategy, length) case in sweep order: by length, then strategy, so a slow length shows up early."""
  return [configure(base, s, n, num_devices, num_slices, context, steps, platform) for n in seq_lens
          for s in strategies]


def describe(config: Config, num_devices: int, num_slices: int = 1) -> str:
  sizes = mesh_lib.axis_sizes(config.mesh, num_devices, num_slices)
  return " × ".join(f"{a}={s}" for a, s in sizes.items() if s > 1) or "1 device"

