"""The schema of run.stages: each stage's steps and the keys it sets, read from YAML into typed `StageSpec`s
(maxctx.config builds them with the rest of the config; maxctx.stages runs them)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from maxctx.config_types import at_least, coerce, plain, record_type, rules
from maxctx.errors import ConfigError, excerpt

# The keys a stage of run.stages may change (a section name: any key in it). The rest fix the parameters, the optimizer
# state's structure or the document streams, which carry over from one stage to the next.
STAGE_KEYS = ("data.seq_len", "data.batch_size", "data.mixture", "data.long_threshold", "data.long_weight",
              "model.rope_theta", "model.rope_scaling", "model.rope_factor", "model.rope_low_freq_factor",
              "model.rope_high_freq_factor", "model.rope_original_context", "model.remat", "model.remat_group",
              "model.loss_chunk", "model.mlp_chunk", "optim.lr", "optim.warmup_steps", "optim.decay_steps",
              "optim.min_lr_ratio", "optim.weight_decay", "optim.grad_accum", "attention", "mesh")


@dataclasses.dataclass(frozen=True)
class StageSpec:
  """One entry of run.stages: the steps it trains and the keys it sets (dotted, values typed), in the YAML as one
  mapping, e.g. `{steps: 200, data.seq_len: 1024, model: {rope_theta: 5.0e+5}}` (maxctx.stages runs them)."""
  steps: int = rules(at_least(1, "the steps this stage trains"))
  reset_schedule: bool = False    # the learning-rate schedule starts afresh at this stage (warm-up, then decay)
  overrides: tuple[tuple[str, Any], ...] = ()

  def entry(self) -> dict[str, Any]:
    """The stage as its YAML mapping."""
    out: dict[str, Any] = {"steps": self.steps}
    if self.reset_schedule:
      out["reset_schedule"] = True
    out.update({k: plain(dataclasses.asdict(v) if dataclasses.is_dataclass(v) else
                         [dataclasses.asdict(e) for e in v] if isinstance(v, tuple) else v)
                for k, v in self.overrides})
    return out



def parse(value: Any, dotted: str, schema_type: Callable[[str], Any], build_records: Callable[[type, Any, str], tuple],
          unknown_key: Callable[[str, dict, str, str], str]) -> tuple[StageSpec, ...]:
  """run.stages: a list of mappings, each `steps`, optionally `reset_schedule`, and keys of STAGE_KEYS (dotted or
  nested), each value checked against its key's type now, so a bad stage is refused with the rest of the config."""
  if value is None:
    return ()
  if not isinstance(value, (list, tuple)):
    raise ConfigError(f"config key {dotted} expects a list of stages, got {excerpt(value)}; write it as YAML, e.g. "
                      f"{dotted}=[{{steps: 100}}, {{steps: 100, data.seq_len: 4096}}].")
  out = []
  for i, entry in enumerate(value):
    where = f"{dotted}[{i}]"
    if not isinstance(entry, dict):
      raise ConfigError(f"config key {where} expects a mapping (steps and the keys the stage sets), got "
                        f"{excerpt(entry)}.")
    keys = _flat_keys(entry, where)
    if "steps" not in keys:
      raise ConfigError(f"config key {where} has no steps; give every stage the number of steps it trains, e.g. "
                        f"{{steps: 100, data.seq_len: 4096}}.")
    steps = coerce(keys.pop("steps"), int, f"{where}.steps")
    reset = coerce(keys.pop("reset_schedule", False), bool, f"{where}.reset_schedule")
    overrides = []
    for key, v in keys.items():
      tp = schema_type(key)
      if tp is None:
        raise ConfigError(unknown_key(key, dict.fromkeys(["steps", "reset_schedule"]), "", where))
      if not any(key == k or key.startswith(k + ".") for k in STAGE_KEYS):
        raise ConfigError(f"config key {key} cannot change between stages ({where}): the parameters, the optimizer "
                          "state and the data streams carry over from one stage to the next; a stage may set "
                          f"{', '.join(STAGE_KEYS[:5])}, model.rope_*, model.remat*, model.*_chunk, optim's schedule "
                          "keys, attention.* and mesh.*.")
      record = record_type(tp)
      overrides.append((key, build_records(record, v, f"{where}.{key}") if record else coerce(v, tp, f"{where}.{key}")))
    out.append(StageSpec(steps=steps, reset_schedule=reset, overrides=tuple(overrides)))
  return tuple(out)


def _flat_keys(entry: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
  """A stage's mapping as {dotted key: value}: `data: {seq_len: 8}` and `data.seq_len: 8` alike, but not both."""
  out: dict[str, Any] = {}
  for k, v in entry.items():
    key = f"{prefix}{k}"
    nested = isinstance(v, dict) and key not in ("steps", "reset_schedule")
    flat = _flat_keys(v, where, key + ".") if nested else {key: v}
    for dotted, value in flat.items():
      if dotted in out:
        raise ConfigError(f"config key {where} sets {dotted} twice (once dotted, once nested); keep one of them.")
      out[dotted] = value
  return out
