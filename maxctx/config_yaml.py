"""A config file's YAML: PyYAML's safe loader, made strict where a run file could flood memory or mislead.

- Aliases (`*name`, hence also `<<: *name`) are refused: nine levels of nine aliases in a few lines expand to hundreds
  of millions of values (a "billion laughs"), and a config, flat sections of scalars, has no use for them (base.yml and
  configs/ use none).
- A key given twice in one mapping is refused, naming both lines: YAML's last-one-wins would drop the first silently.
- Tags beyond plain data (`!!python/object`, ...) are refused by the safe loader itself.
"""

from __future__ import annotations

from typing import Any

import yaml

from maxctx.errors import EXCERPT_CHARS, ConfigError

_MERGE = "tag:yaml.org,2002:merge"


class Refused(yaml.YAMLError):
  """Valid YAML that a config may not use; the message is the rest of the sentence after the file's name."""


class _Loader(yaml.SafeLoader):

  def compose_node(self, parent, index):
    if self.check_event(yaml.AliasEvent):
      event = self.peek_event()
      raise Refused(f"line {event.start_mark.line + 1} uses the YAML alias *{event.anchor[:40]}; write the value out "
                    "in full (aliases are refused: a few nested ones expand a small file into gigabytes)")
    return super().compose_node(parent, index)


def _check_keys(node: yaml.Node, prefix: str) -> None:
  """Refuses a key that appears twice in one mapping, anywhere under `node`."""
  if isinstance(node, yaml.SequenceNode):
    for item in node.value:
      _check_keys(item, prefix)
  if not isinstance(node, yaml.MappingNode):
    return
  lines: dict[str, int] = {}
  for key, value in node.value:
    if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE:
      name, line = key.value, key.start_mark.line + 1
      if name in lines:   # the whole key decides; the message shows its start
        raise Refused(f"gives {prefix}{name[:60]} twice (lines {lines[name]} and {line}); keep one, since YAML would "
                      "use the last silently")
      lines[name] = line
      _check_keys(value, f"{prefix}{name[:60]}.")
    else:
      _check_keys(value, prefix)


def loads(text: str) -> Any:
  """The value of a YAML document, strictly (no aliases, no repeated keys); raises yaml.YAMLError (Refused)."""
  loader = _Loader(text)
  try:
    node = loader.get_single_node()
    if node is None:
      return None
    _check_keys(node, "")
    return loader.construct_document(node)
  finally:
    loader.dispose()


def read(path) -> dict[str, Any]:
  """A config file's mapping of sections; ConfigError in one sentence when it cannot be read, is not valid YAML, uses
  what `loads` refuses, or is not a mapping. `path` is anything with read_text() (a pathlib or importlib path)."""
  try:
    text = path.read_text()
  except OSError as e:
    raise ConfigError(f"cannot read config file {path}: {e.strerror}; check the path.") from None
  except UnicodeDecodeError as e:
    raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                      "give a YAML file.") from None
  try:
    tree = loads(text)
  except Refused as e:
    raise ConfigError(f"config file {path} {e}.") from None
  except yaml.constructor.ConstructorError as e:  # a tag such as !!python/object: not plain data
    line = e.problem_mark.line + 1 if e.problem_mark else "?"
    raise ConfigError(f"config file {path} line {line} holds a value YAML's safe loader does not build "
                      f"({str(e.problem)[:EXCERPT_CHARS]}); write plain values (numbers, strings, lists).") from None
  except yaml.YAMLError as e:
    where = getattr(e, "problem_mark", None)
    line = f" line {where.line + 1}" if where else ""
    problem = str(getattr(e, "problem", None) or e)[:EXCERPT_CHARS]
    raise ConfigError(f"config file {path}{line} is not valid YAML ({problem}); fix the syntax.") from None
  if tree is None:
    return {}
  if not isinstance(tree, dict):
    raise ConfigError(f"config file {path} must hold a mapping of sections, not a {type(tree).__name__}.")
  return tree
