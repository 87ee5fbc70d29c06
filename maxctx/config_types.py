"""Typed values for the config: a YAML value checked against (and converted to) a schema field's type, and the
rules on a value that the schema declares beside each key."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Callable, Literal

from maxctx.errors import ConfigError, excerpt


def _type_name(tp: Any) -> str:
  if typing.get_origin(tp) is Literal:
    return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
  if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
    return " or ".join(_type_name(a) for a in typing.get_args(tp))
  if tp is type(None):
    return "null"
  return tp.__name__


def coerce(value: Any, tp: Any, key: str) -> Any:
  """`value` as type `tp` (Literal, union, bool, int, float, str), or a ConfigError naming `key`."""
  origin = typing.get_origin(tp)
  if isinstance(tp, types.UnionType) or origin is typing.Union:
    errors = []
    for arm in typing.get_args(tp):
      try:
        return coerce(value, arm, key)
      except ConfigError as e:
        errors.append(e)
    raise ConfigError(f"config key {key} expects {_type_name(tp)}, got {excerpt(value)} ({type(value).__name__}).")
  if origin is Literal:
    choices = typing.get_args(tp)
    if value not in choices:
      close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      raise ConfigError(f"config key {key} must be one of {', '.join(map(repr, choices))}, got {excerpt(value)}{hint}.")
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
        raise ConfigError(f"config key {key} is {excerpt(value)}; it must be a finite number.")
      return number
  elif tp is str:
    if isinstance(value, str):
      return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return str(value)
  else:
    raise TypeError(f"unsupported schema type {tp!r} for {key}")
  raise ConfigError(f"config key {key} expects {_type_name(tp)}, got {excerpt(value)} ({type(value).__name__}).")


def record_type(tp: Any) -> type | None:
  """The record of a list-of-records key (`tuple[Record, ...]`), else None."""
  args = typing.get_args(tp)
  if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis and dataclasses.is_dataclass(args[0]):
    return args[0]
  return None


def plain(tree: Any) -> Any:
  """asdict's tuples (a list of records) as lists: what YAML writes and JSON reads back."""
  if isinstance(tree, dict):
    return {k: plain(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [plain(v) for v in tree]
  return tree


# ---------------------------------------------------------------------------------------------------------------------
# Rules on one key's value, declared beside the key in the schema (maxctx.config) and applied by config.check. A rule
# takes the dotted key and the value and returns the one-sentence error, or None. Rules between keys, or against the
# devices, belong to the components that read the keys (maxctx.trainer.validate calls each once).

Rule = Callable[[str, Any], "str | None"]


def rules(*checks: Rule) -> Any:
  """A schema field whose value must pass `checks`. No default: base.yml holds the defaults."""
  return dataclasses.field(metadata={"rules": checks})


def _bound(least: float, most: float | None, closed: bool, why: str) -> Rule:
  def rule(key: str, value: Any) -> str | None:
    if value is None:   # null means "the default" where the type allows it
      return None
    if value < least or (value == least and not closed) or (most is not None and value > most):
      allowed = f"in [{least:g}, {most:g}]" if most is not None else f"{'at least' if closed else 'above'} {least:g}"
      return f"{key} is {value:g}; it must be {allowed}{f' ({why})' if why else ''}."
    return None
  return rule


def at_least(least: float, why: str = "") -> Rule:
  return _bound(least, None, True, why)


def above(least: float, why: str = "") -> Rule:
  return _bound(least, None, False, why)


def within(least: float, most: float, why: str = "") -> Rule:
  return _bound(least, most, True, why)


def even(why: str) -> Rule:
  return lambda key, value: None if value % 2 == 0 else f"{key} {value} must be even {why}."


def check(section: Any, prefix: str = "") -> None:
  """Refuses a value no run can use, naming the key and what it must be: the rules the schema declares beside each
  key of `section` (a whole Config, or one section with its dotted `prefix`, e.g. "mesh.ici.")."""
  for f in dataclasses.fields(section):
    value = getattr(section, f.name)
    if dataclasses.is_dataclass(value):
      check(value, f"{prefix}{f.name}.")
      continue
    if isinstance(value, tuple):   # a list of records
      for i, entry in enumerate(value):
        if dataclasses.is_dataclass(entry):
          check(entry, f"{prefix}{f.name}[{i}].")
      continue
    for rule in f.metadata.get("rules", ()):
      if (broken := rule(prefix + f.name, value)) is not None:
        raise ConfigError(broken)
