"""Several document sources in one stream (data.mixture), and long-document up-sampling (data.long_threshold).

A weight is a source's share of the training *tokens*. Each row of the batch keeps its own stream (dataset.py): for
every source, documents r, r+B, r+2B, ... of that source's seeded shuffle; the row's next document comes from the
source furthest below its share of the (token, target) pairs the row took so far (ties: the first listed). So the
shares follow the weights however long each source's documents are, to within one document per source, and the
choice needs no random state: the row's position is its sources' positions and its pair counts, which the packer's
checkpointed state holds (its parent's state), so a resumed run takes the very same documents.

Why not grain's `mix`: its proportions count documents (a 100K-token book weighs as much as a 50-token snippet, so
token shares would follow each source's mean length), and it interleaves in a fixed order.

Each mixture document leaves here as a (document, source index) pair, the document untouched (no copy: first-fit
holds open sequences' documents by reference); the packer counts each sequence's pairs per source as it places each
piece (a host-only `source_tokens` vector per row), and the pipeline sums those counts until the shares are read.

Up-sampling: within a source, a document of at least data.long_threshold tokens is drawn data.long_weight times as
often as a shorter one, by keeping each short document with probability 1/long_weight (each long one with
probability long_weight when it is below 1), decided by a coin seeded per document (grain's random_map).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import grain
import numpy as np

from maxctx.config import Config
from maxctx.errors import ConfigError


def check(config: Config) -> None:
  """data.source and data.mixture name one stream: `mixture` with a non-empty list, or another source without one."""
  d = config.data
  if d.mixture and d.source != "mixture":
    raise ConfigError(f"data.mixture lists {len(d.mixture)} source(s) but data.source is {d.source}; set "
                      "data.source=mixture to train on the mixture, or data.mixture=[] to train on data.source alone.")
  if d.source == "mixture" and not d.mixture:
    raise ConfigError("data.source is mixture but data.mixture is empty; list the sources, e.g. "
                      "'data.mixture=[{source: text, path: a.txt, weight: 3}, {source: jsonl, path: b.jsonl, "
                      "weight: 1}]'.")
  names = [name(d, i) for i in range(len(d.mixture))]
  if len(set(names)) < len(names):
    raise ConfigError(f"data.mixture names two sources alike ({', '.join(names)}); give each a different name.")


def name(data, i: int) -> str:
  """Source i's name in TensorBoard (data/share/<name>)."""
  return data.mixture[i].name or str(i)


def source_seed(run_seed: int, i: int) -> int:
  """Source i's shuffle seed: each source in its own order, all fixed by run.seed."""
  return int(np.random.SeedSequence([run_seed % 2**32, i]).generate_state(1)[0])


def upsampling(data) -> float | None:
  """How much more often a long document is kept than a short one; None when up-sampling is off."""
  if data.long_threshold <= 0 or data.long_weight == 1.0:
    return None
  return data.long_weight


def empty_allowance(data) -> int:
  """How many more documents in a row may be dropped by up-sampling before a row counts as starved: at 64 × the
  odds against keeping one, a run that long happens by chance with probability below e^-64."""
  weight = upsampling(data)
  return 1 if weight is None else 64 * math.ceil(max(weight, 1 / weight))


class Upsample(grain.transforms.RandomMap):
  """A document, or an empty one (which the packer skips) when its seeded coin drops it."""

  def __init__(self, threshold: int, weight: float):
    self._threshold, self._weight = threshold, weight

  def random_map(self, doc: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    keep = min(1.0, self._weight) if len(doc) >= self._threshold else min(1.0, 1 / self._weight)
    return doc if keep == 1.0 or rng.random() < keep else doc[:0]


class _MixIterator(grain.DatasetIterator):

  def __init__(self, parents: Sequence[grain.DatasetIterator], shares: Sequence[float], seq_len: int | None):
    super().__init__(list(parents))
    self._shares, self._seq_len = tuple(shares), seq_len
    self._taken = [0] * len(parents)
    self._first: int | None = None   # a source the next pick must take (a stage continuing a document in progress)

  def __next__(self) -> tuple[np.ndarray, int]:
    i = min(range(len(self._shares)), key=lambda j: self._taken[j] / self._shares[j])
    if self._first is not None:
      i, self._first = self._first, None
    doc = next(self._parents[i])
    pairs = max(len(doc) - 1, 0)
    # What the packer will use of it: long_documents=truncate keeps one sequence's worth.
    self._taken[i] += min(pairs, self._seq_len) if self._seq_len else pairs
    return doc, i

  def get_state(self) -> dict[str, Any]:
    out = {"parents": [p.get_state() for p in self._parents], "taken": list(self._taken)}
    if self._first is not None:
      out["first"] = self._first
    return out

  def set_state(self, state: dict[str, Any]) -> None:
    for p, s in zip(self._parents, state["parents"], strict=True):
      p.set_state(s)
    self._taken = [int(t) for t in state["taken"]]
    self._first = state.get("first")


class MixIterDataset(grain.IterDataset):
  """Documents from `parents` (one stream of 1-D int32 documents per source) as (document, source index), each taken
  from the source furthest below its share (`weights`, normalised) of the pairs so far. `truncate_at`: the packer keeps
  at most this many pairs of a document (long_documents=truncate), so only those count."""

  def __init__(self, parents: Sequence[grain.IterDataset], weights: Sequence[float], truncate_at: int | None = None):
    super().__init__(list(parents))
    total = sum(weights)
    self._shares, self._truncate_at = [w / total for w in weights], truncate_at

  def __iter__(self) -> _MixIterator:
    return _MixIterator([p.__iter__() for p in self._parents], self._shares, self._truncate_at)

  def __str__(self) -> str:
    return f"MixIterDataset(shares={self._shares})"
