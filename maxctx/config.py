"""Run configuration: typed, frozen sections read from YAML with dotted command-line overrides.

Resolution order, later wins:
  configs/base.yml (every key, with its default and a comment)
  configs/models/<model.preset>.yml (the model's published dimensions)
  the run file (e.g. configs/demo.yml)
  command-line overrides `section.key=value`

The dataclasses below are the schema (names and types); base.yml holds the defaults. A test keeps the two in step.
An unknown key names the closest valid key; a value of the wrong type names the key, the value and the expected type.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import pathlib
import types
import typing
from typing import Any, Literal

import yaml

from maxctx.errors import ConfigError

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
MESH_AXES = ("data", "fsdp", "context", "tensor")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  name: str
  output_dir: str
  steps: int
  seed: int
  on_nan: Literal["stop", "skip"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  preset: str
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  norm_eps: float
  rope_theta: float
  rope_scaling: bool
  rope_factor: float
  rope_low_freq_factor: float
  rope_high_freq_factor: float
  rope_original_context: int
  init_std: float
  dtype: Literal["float32", "bfloat16"]
  param_dtype: Literal["float32", "bfloat16"]
  remat: Literal["none", "full", "full_offload", "save_dots", "save_attention_out"]
  scan_layers: bool
  loss_chunk: int
  mlp_chunk: int


@dataclasses.dataclass(frozen=True)
class AxesConfig:
  data: int
  fsdp: int
  context: int
  tensor: int


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  ici: AxesConfig
  dcn: AxesConfig


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  strategy: str
  kernel: str
  load_balance: bool
  ulysses_degree: int | None
  block_q: int | None
  block_kv: int | None


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str
  seq_len: int
  batch_size: int
  path: str
  text_field: str
  text_separator: str
  tokenizer: str
  packing: Literal["first_fit", "concat"]
  long_documents: Literal["split", "truncate"]
  bad_records: Literal["error", "skip"]
  shuffle: bool
  num_workers: int
  prefetch: int


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  lr: float
  warmup_steps: int
  decay_steps: int
  min_lr_ratio: float
  b1: float
  b2: float
  eps: float
  weight_decay: float
  clip_norm: float
  grad_accum: int


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int
  keep: int
  resume: str
  load_params: str
  async_save: bool
  overwrite: bool


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
  log_every: int
  tensorboard: bool
  peak_tflops: float


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  every_steps: int
  tasks: str
  lengths: str
  depths: str
  samples: int
  batch_size: int
  seed: int
  files: str
  output_dir: str


@dataclasses.dataclass(frozen=True)
class CompileConfig:
  topology: str
  num_slices: int


@dataclasses.dataclass(frozen=True)
class Config:
  run: RunConfig
  model: ModelConfig
  mesh: MeshConfig
  attention: AttentionConfig
  data: DataConfig
  optim: OptimConfig
  checkpoint: CheckpointConfig
  metrics: MetricsConfig
  eval: EvalConfig
  compile: CompileConfig

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_yaml(self) -> str:
    return yaml.safe_dump(self.to_dict(), sort_keys=False)

  def replace(self, **overrides: Any) -> Config:
    """Returns a copy with dotted overrides applied, validated like the command line: replace(**{"run.steps": 5})."""
    tree = self.to_dict()
    for dotted, value in overrides.items():
      _set_dotted(tree, dotted, value, "replace()")
    return _build(Config, tree, "")


# ---------------------------------------------------------------------------------------------------------------------
# Loading.


def _read_yaml(path: pathlib.Path) -> dict[str, Any]:
  try:
    text = path.read_text()
  except OSError as e:
    raise ConfigError(f"cannot read config file {path}: {e.strerror}; check the path.") from None
  try:
    tree = yaml.safe_load(text)
  except yaml.YAMLError as e:
    where = getattr(e, "problem_mark", None)
    line = f" line {where.line + 1}" if where else ""
    problem = getattr(e, "problem", e)
    raise ConfigError(f"config file {path}{line} is not valid YAML ({problem}); fix the syntax.") from None
  if tree is None:
    return {}
  if not isinstance(tree, dict):
    raise ConfigError(f"config file {path} must hold a mapping of sections, not a {type(tree).__name__}.")
  return tree


def _merge(base: dict[str, Any], over: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
  out = dict(base)
  for key, value in over.items():
    dotted = f"{prefix}{key}"
    if key not in base:
      raise ConfigError(_unknown_key_message(dotted, base, prefix, where))
    if isinstance(base[key], dict):
      if not isinstance(value, dict):
        raise ConfigError(f"config key {dotted} in {where} is a section and needs a mapping, not {value!r}.")
      out[key] = _merge(base[key], value, where, dotted + ".")
    else:
      out[key] = value
  return out


def _closest_key(dotted: str, siblings: list[str], prefix: str) -> str | None:
  # An abbreviation first (learning_rate → lr, grad_accumulation → ga...), then spelling.
  leaf = dotted.rsplit(".", 1)[-1]
  initials = "".join(w[0] for w in leaf.split("_") if w)
  if len(initials) > 1 and initials in siblings:
    return prefix + initials
  close = difflib.get_close_matches(dotted, [prefix + k for k in siblings] + schema_keys(), n=1, cutoff=0.5)
  return close[0] if close else None


def _unknown_key_message(dotted: str, siblings: dict[str, Any], prefix: str, where: str) -> str:
  close = _closest_key(dotted, list(siblings), prefix)
  hint = f"did you mean {close}?" if close else "see configs/base.yml for every key."
  return f"unknown config key {dotted} in {where}; {hint}"


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, where: str) -> None:
  parts = dotted.split(".")
  node = tree
  for i, part in enumerate(parts):
    prefix = ".".join(parts[:i]) + ("." if i else "")
    if not isinstance(node, dict) or part not in node:
      raise ConfigError(_unknown_key_message(dotted, node if isinstance(node, dict) else {}, prefix, where))
    if i == len(parts) - 1:
      if isinstance(node[part], dict):
        raise ConfigError(f"config key {dotted} in {where} is a section; set one of its keys, e.g. {dotted}."
                          f"{next(iter(node[part]))}=...")
      node[part] = value
    else:
      node = node[part]


def parse_override(arg: str) -> tuple[str, Any]:
  """`section.key=value` → (dotted key, YAML-parsed value)."""
  if "=" not in arg:
    raise ConfigError(f"command-line argument {arg!r} is not of the form section.key=value (e.g. run.steps=20).")
  key, text = arg.split("=", 1)
  try:
    value = yaml.safe_load(text) if text != "" else ""
  except yaml.YAMLError:
    value = text
  return key.strip(), value


def load(path: str | pathlib.Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
  """Reads base.yml, the model preset, the run file and the overrides into a validated Config."""
  base = _read_yaml(CONFIG_DIR / "base.yml")
  run_tree: dict[str, Any] = {}
  run_where = "the defaults"
  if path is not None:
    path = pathlib.Path(path)
    run_tree = _read_yaml(path)
    run_where = str(path)
    # `model: llama3.1-8b` is shorthand for `model: {preset: llama3.1-8b}`.
    if isinstance(run_tree.get("model"), str):
      run_tree["model"] = {"preset": run_tree["model"]}
  parsed = [parse_override(a) for a in overrides]

  preset = dict(parsed).get("model.preset", (run_tree.get("model") or {}).get("preset", base["model"]["preset"]))
  tree = base
  if preset:
    preset_path = CONFIG_DIR / "models" / f"{preset}.yml"
    if not preset_path.exists():
      known = sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.yml"))
      close = difflib.get_close_matches(str(preset), known, n=1)
      hint = f"did you mean {close[0]}?" if close else f"known presets: {', '.join(known)}."
      raise ConfigError(f"model preset {preset!r} has no file configs/models/{preset}.yml; {hint}")
    tree = _merge(tree, {"model": _read_yaml(preset_path)}, str(preset_path))
  tree = _merge(tree, run_tree, run_where)
  for key, value in parsed:
    _set_dotted(tree, key, value, "the command line")
  tree["model"]["preset"] = preset or ""
  return _build(Config, tree, "")


def from_dict(tree: dict[str, Any]) -> Config:
  """A Config from a complete nested dict (e.g. a saved config.yml)."""
  return _build(Config, tree, "")


# ---------------------------------------------------------------------------------------------------------------------
# Typed construction.


def _type_name(tp: Any) -> str:
  if typing.get_origin(tp) is Literal:
    return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
  if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
    return " or ".join(_type_name(a) for a in typing.get_args(tp))
  if tp is type(None):
    return "null"
  return tp.__name__


def _coerce(value: Any, tp: Any, key: str) -> Any:
  origin = typing.get_origin(tp)
  if isinstance(tp, types.UnionType) or origin is typing.Union:
    errors = []
    for arm in typing.get_args(tp):
      try:
        return _coerce(value, arm, key)
      except ConfigError as e:
        errors.append(e)
    raise ConfigError(f"config key {key} expects {_type_name(tp)}, got {value!r} ({type(value).__name__}).")
  if origin is Literal:
    choices = typing.get_args(tp)
    if value not in choices:
      close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      raise ConfigError(f"config key {key} must be one of {', '.join(map(repr, choices))}, got {value!r}{hint}.")
    return value
  if tp is type(None):
    if value is None:
      return None
  elif tp is bool:
    if isinstance(value, bool):
      return value
  elif tp is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    if isinstance(value, str):
      try:
        return int(value)
      except ValueError:
        pass
  elif tp is float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      number = float(value)
    elif isinstance(value, str):  # PyYAML reads 3e-4 (no dot) as a string.
      try:
        number = float(value)
      except ValueError:
        pass
    if number is not None:
      # nan or inf would compile and run, and fail steps later with a message about something else.
      if not math.isfinite(number):
        raise ConfigError(f"config key {key} is {value!r}; it must be a finite number.")
      return number
  elif tp is str:
    if isinstance(value, str):
      return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return str(value)
  else:
    raise TypeError(f"unsupported schema type {tp!r} for {key}")
  raise ConfigError(f"config key {key} expects {_type_name(tp)}, got {value!r} ({type(value).__name__}).")


def _build(cls: type, tree: dict[str, Any], prefix: str) -> Any:
  hints = typing.get_type_hints(cls)
  kwargs = {}
  names = [f.name for f in dataclasses.fields(cls)]
  for key in tree:
    if key not in hints:
      raise ConfigError(_unknown_key_message(prefix + key, dict.fromkeys(names), prefix, "the config"))
  for name in names:
    tp = hints[name]
    dotted = prefix + name
    if name not in tree:
      raise ConfigError(f"config key {dotted} is missing; every key needs a value (see configs/base.yml).")
    if dataclasses.is_dataclass(tp):
      if not isinstance(tree[name], dict):
        raise ConfigError(f"config key {dotted} is a section and needs a mapping, not {tree[name]!r}.")
      kwargs[name] = _build(tp, tree[name], dotted + ".")
    else:
      kwargs[name] = _coerce(tree[name], tp, dotted)
  return cls(**kwargs)


def schema_keys(cls: type = Config, prefix: str = "") -> list[str]:
  """Every leaf key of the schema, dotted; base.yml must define exactly these."""
  keys = []
  for f, tp in zip(dataclasses.fields(cls), typing.get_type_hints(cls).values()):
    if dataclasses.is_dataclass(tp):
      keys.extend(schema_keys(tp, f"{prefix}{f.name}."))
    else:
      keys.append(prefix + f.name)
  return keys


def save(config: Config, directory: str | pathlib.Path) -> pathlib.Path:
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  path = directory / "config.yml"
  path.write_text(config.to_yaml())
  return path
