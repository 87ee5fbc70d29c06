"""Sequence lengths as people write them: `1k,4k,16k` → [1024, 4096, 16384]; k = 2^10, m = 2^20, plain numbers are
tokens. Read by the config's eval.lengths and by the tools' --lengths flags alike."""

from __future__ import annotations

import re

from maxctx.errors import ConfigError


def parse_lengths(text: str, where: str) -> list[int]:
  """The lengths in `text`, in its order; `where` names the key or flag in the error."""
  out = []
  for part in (p.strip().lower() for p in text.split(",") if p.strip()):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([km]?)", part)
    if not m:
      raise ConfigError(f"{where} has length {part!r}; write lengths in tokens like 512, 4k or 1m, comma-separated.")
    n = float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20}[m.group(2)]
    if n != int(n) or n < 1:
      raise ConfigError(f"{where} has length {part!r}, which is not a whole number of tokens; use e.g. 1k or 1536.")
    out.append(int(n))
  return out
