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
import importlib.resources
import pathlib
import re
import typing
from typing import Any

import yaml

from maxctx import config_stages, config_yaml
from maxctx.config_stages import StageSpec
# The sections' schema, re-exported: maxctx.config is where callers find every config type.
from maxctx.config_schema import (  # noqa: F401
    RunConfig, ModelConfig, AxesConfig, MeshConfig, AttentionConfig, MixtureSource,
    DataConfig, OptimConfig, CheckpointConfig, MetricsConfig, EvalConfig, CompileConfig, axis_size, resume_point)
from maxctx.config_types import check, coerce, plain, record_type  # noqa: F401 (check: the config's own rules)
from maxctx.errors import EXCERPT_CHARS, ConfigError, excerpt

# The repository's configs/, shipped in the package (maxctx/configs links to it in a checkout): base.yml and the model
# presets are found from any working directory, in a wheel as in an editable install. A run file is a plain path.
CONFIG_DIR = pathlib.Path(str(importlib.resources.files("maxctx") / "configs"))
MESH_AXES = ("data", "fsdp", "context", "tensor")
_PRESET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


@dataclasses.dataclass(frozen=True)
class Config:
  """A whole run: one frozen section per top-level key of the YAML."""
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
    tree = plain(dataclasses.asdict(self))
    tree["run"]["stages"] = [s.entry() for s in self.run.stages]
    return tree

  def to_yaml(self) -> str:
    return yaml.safe_dump(self.to_dict(), sort_keys=False)

  def replace(self, **overrides: Any) -> Config:
    """Returns a copy with dotted overrides applied, validated like the command line: replace(**{"run.steps": 5})."""
    tree = self.to_dict()
    for dotted, value in overrides.items():
      _set_dotted(tree, dotted, value, "replace()")
    return _build(Config, tree, "")

  def with_stage(self, i: int) -> Config:
    """This config with the keys of run.stages[0..i] set in order: a stage changes what it names from the stage
    before it (run.stages itself kept)."""
    tree = self.to_dict()
    for j in range(i + 1):
      for dotted, value in self.run.stages[j].entry().items():
        if dotted not in ("steps", "reset_schedule"):
          _set_dotted(tree, dotted, value, f"run.stages[{j}]")
    return _build(Config, tree, "")


# ---------------------------------------------------------------------------------------------------------------------
# Loading.


def _read_yaml(path: pathlib.Path) -> dict[str, Any]:
  return config_yaml.read(path)


def _merge(base: dict[str, Any], over: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
  out = dict(base)
  for key, value in over.items():
    dotted = f"{prefix}{key}"
    if key not in base:
      raise ConfigError(_unknown_key_message(dotted, base, prefix, where))
    if isinstance(base[key], dict):
      if not isinstance(value, dict):
        raise ConfigError(f"config key {dotted} in {where} is a section and needs a mapping, not {excerpt(value)}.")
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
  dotted = dotted[:EXCERPT_CHARS]   # a key is a value a user typed: shown, and matched, in part only
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
    raise ConfigError(f"command-line argument {excerpt(arg)} is not of the form section.key=value (e.g. run.steps=20).")
  key, text = arg.split("=", 1)
  try:
    value = config_yaml.loads(text) if text != "" else ""
  except config_yaml.Refused as e:   # valid YAML that the strict loader refuses is no plain string either
    raise ConfigError(f"command-line argument {excerpt(arg)} {e}.") from None
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
    if not isinstance(preset, str) or not _PRESET_NAME.fullmatch(preset):
      raise ConfigError(f"model.preset {excerpt(preset)} is not a preset name (letters, digits, '.', '_' and '-', as "
                        f"the files in configs/models/ are named); name one of them, or leave model.preset empty.")
    preset_path = CONFIG_DIR / "models" / f"{preset}.yml"
    if not preset_path.exists():
      known = sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.yml"))
      close = difflib.get_close_matches(str(preset), known, n=1)
      hint = f"did you mean {close[0]}?" if close else f"known presets: {', '.join(known)}."
      raise ConfigError(f"model preset {excerpt(preset)} has no file configs/models/{preset}.yml; {hint}")
    tree = _merge(tree, {"model": _read_yaml(preset_path)}, str(preset_path))
  tree = _merge(tree, run_tree, run_where)
  for key, value in parsed:
    _set_dotted(tree, key, value, "the command line")
  tree["model"]["preset"] = preset or ""
  config = _build(Config, tree, "")
  steps_set = "run.steps" in dict(parsed) or "steps" in (run_tree.get("run") or {})
  if config.run.stages and not steps_set:   # run.steps of a staged run is its stages' sum unless the run says it
    config = dataclasses.replace(config, run=dataclasses.replace(
        config.run, steps=sum(s.steps for s in config.run.stages)))
  return config


def from_dict(tree: dict[str, Any]) -> Config:
  """A Config from a complete nested dict (e.g. a saved config.yml)."""
  return _build(Config, tree, "")


def from_saved(tree: dict[str, Any]) -> Config:
  """A Config from a dict an older maxctx saved (a checkpoint's): keys added since take base.yml's defaults, keys
  since removed are dropped."""
  def known(base: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    return {k: known(v, saved[k]) if isinstance(v, dict) and isinstance(saved.get(k), dict) else saved.get(k, v)
            for k, v in base.items()}
  return _build(Config, known(_read_yaml(CONFIG_DIR / "base.yml"), tree), "")


# ---------------------------------------------------------------------------------------------------------------------
# Typed construction.


def _build(cls: type, tree: dict[str, Any], prefix: str) -> Any:
  hints = typing.get_type_hints(cls)
  kwargs = {}
  fields = {f.name: f for f in dataclasses.fields(cls)}
  for key in tree:
    if key not in hints:
      raise ConfigError(_unknown_key_message(prefix + key, dict.fromkeys(fields), prefix, "the config"))
  for name, f in fields.items():
    tp = hints[name]
    dotted = prefix + name
    if name not in tree:
      if f.default is not dataclasses.MISSING:   # a record's optional key
        continue
      raise ConfigError(f"config key {dotted} is missing; every key needs a value (see configs/base.yml).")
    if dataclasses.is_dataclass(tp):
      if not isinstance(tree[name], dict):
        raise ConfigError(f"config key {dotted} is a section and needs a mapping, not {excerpt(tree[name])}.")
      kwargs[name] = _build(tp, tree[name], dotted + ".")
    elif tp == tuple[StageSpec, ...]:
      kwargs[name] = config_stages.parse(tree[name], dotted, _schema_type, _build_records, _unknown_key_message)
    elif record := record_type(tp):
      kwargs[name] = _build_records(record, tree[name], dotted)
    else:
      kwargs[name] = coerce(tree[name], tp, dotted)
  return cls(**kwargs)


def _build_records(record: type, value: Any, dotted: str) -> tuple:
  """A YAML list of mappings (block, or flow: `[{a: 1}, {a: 2}]`) as `record`s, keys named `dotted[i].key`."""
  if value is None:
    return ()
  if not isinstance(value, (list, tuple)):
    raise ConfigError(f"config key {dotted} expects a list of mappings, got {excerpt(value)}; write it as YAML, e.g. "
                      f"{dotted}=[{{source: text, path: a.txt, weight: 1}}].")
  out = []
  for i, entry in enumerate(value):
    if not isinstance(entry, dict):
      raise ConfigError(f"config key {dotted}[{i}] expects a mapping of keys, got {excerpt(entry)}.")
    out.append(_build(record, entry, f"{dotted}[{i}]."))
  return tuple(out)


def _schema_type(dotted: str) -> Any:
  """The schema type of a dotted leaf key, or None if no such key."""
  cls: Any = Config
  parts = dotted.split(".")
  for i, part in enumerate(parts):
    hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    if part not in hints:
      return None
    cls = hints[part]
  return None if dataclasses.is_dataclass(cls) else cls


def schema_keys(cls: type = Config, prefix: str = "") -> list[str]:
  """Every leaf key of the schema, dotted; base.yml must define exactly these."""
  keys = []
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    tp = hints[f.name]
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
