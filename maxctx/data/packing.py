"""Packing documents into sequences of exactly `seq_len` (token, target) pairs, as a grain IterDataset.

A document of L tokens gives L−1 pairs (tokens[t], targets[t] = the next token), so no target crosses a document
boundary. A document with more than `seq_len` pairs is cut into pieces of at most `seq_len` pairs that become
documents of their own (`split`), or keeps only its first piece (`truncate`). Every sequence carries

  tokens, targets   the pairs, 0 in padding
  segment_ids       1..n for the n pieces in the sequence, 0 in padding
  positions         0..len−1 inside each piece, 0 in padding
  source_tokens     only with `sources` > 0 (a mixture, whose documents come as (document, source index)): int64
                    [sources], the sequence's pairs from each source, counted per piece as it is placed; it stays on
                    the host (the pipeline sums it), the model never sees it

Methods:
  first_fit  a round fills up to `bins` open sequences, each piece going to the first with room; when a piece fits
             none and no more may open, the round's sequences are emitted in order and the piece starts the next round.
  concat     pieces are concatenated and the stream is cut every `seq_len` pairs; a piece cut at a sequence end
             continues as a new piece (positions restart) in the next sequence. No padding except at the very end.

Why not grain's FirstFitPackIterDataset: at 14,680,064 tokens it packs ~15M tokens/s and holds `num_packing_bins`
full-length arrays per feature (1.2 GB for one bin); here open sequences hold views of the documents and are written
once, at emission, with vectorized segment ids and positions (see scripts/bench_packing.py).

Resume is exact without storing tokens: the state is the parent's state before the document where the current round
began, the pair offset into that document, and how many of the round's sequences were already emitted. Restoring
re-packs that one round (at most `bins` sequences) and skips what was emitted.
"""

from __future__ import annotations

from typing import Any, Literal

import grain
import numpy as np

from maxctx.errors import DataError

FIELDS = ("tokens", "targets", "segment_ids", "positions")
SOURCE_TOKENS = "source_tokens"

# first_fit keeps at most this many tokens in open sequences (and never more than MAX_BINS of them): at 14,680,064
# tokens a round is 4 sequences (their documents, held by reference, cost 4 × 59 MB), at 8K it is 16.
OPEN_TOKENS = 1 << 26
MAX_BINS = 16


def default_bins(seq_len: int) -> int:
  return int(np.clip(OPEN_TOKENS // seq_len, 1, MAX_BINS))


def write_sequence(pieces: list[np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
  """One packed sequence of FIELDS from pieces, each a document view of n+1 tokens holding n pairs."""
  out = np.zeros((4, seq_len), np.int32)
  tokens, targets, segment_ids, positions = out
  starts = np.empty(len(pieces), np.int64)
  t = 0
  for i, p in enumerate(pieces):
    n = len(p) - 1
    tokens[t:t + n] = p[:-1]
    targets[t:t + n] = p[1:]
    starts[i] = t
    t += n
  # Segment ids and positions as running sums of a sparse pattern, in place: per-piece fills cost too much at ~100
  # tokens per document, and np.repeat/arange would allocate three more sequence-sized temporaries.
  segment_ids[starts] = 1
  np.add.accumulate(segment_ids[:t], out=segment_ids[:t])
  positions[:t] = 1
  positions[starts[1:]] = 1 - np.diff(starts).astype(np.int32)
  positions[0] = 0
  np.add.accumulate(positions[:t], out=positions[:t])
  return dict(zip(FIELDS, out))


class _PackIterator(grain.DatasetIterator):

  def __init__(self, parent: grain.DatasetIterator, seq_len: int, method: str, long_documents: str, bins: int,
               max_empty: int | None = None, starved: str = "", sources: int = 0):
    super().__init__(parent)
    self._seq_len, self._method, self._truncate, self._bins = seq_len, method, long_documents == "truncate", bins
    self._sources, self._source = sources, 0   # the current document's source index, with `sources` > 0
    self._max_empty, self._starved, self._empty = max_empty, starved, 0
    self._reset(parent.get_state(), 0)

  def _reset(self, doc_state: Any, offset: int) -> None:
    # The cursor: the parent state before the current document, the document (None = not read yet) and how many of
    # its pairs were consumed.
    self._doc_state, self._doc, self._offset = doc_state, None, offset
    self._exhausted = False
    self._round: list[list[np.ndarray]] = []  # Finished sequences of the current round, as lists of pieces.
    self._counts: list[np.ndarray | None] = []   # Per sequence of the round: its pairs per source (with sources).
    self._round_start = (doc_state, offset)
    self._emitted = 0

  def _peek(self) -> int:
    """Pairs in the next piece (reading documents as needed); 0 when the parent is exhausted."""
    while True:
      if self._doc is not None:
        pairs = len(self._doc) - 1
        left = (min(pairs, self._seq_len) if self._truncate else pairs) - self._offset
        if left > 0:
          return min(left, self._seq_len)
        self._doc = None
      if self._exhausted:
        return 0
      state = self._parent.get_state()
      try:
        doc = next(self._parent)
      except StopIteration:
        self._exhausted = True
        return 0
      if self._sources:
        doc, self._source = doc
      self._doc_state, self._doc, self._offset = state, doc, 0
      self._empty = self._empty + 1 if len(doc) < 2 else 0
      if self._max_empty and self._empty > self._max_empty:
        raise DataError((self._starved or "{n} documents in a row held no (token, target) pair; the data holds too "
                         "few usable documents.").replace("{n}", str(self._empty)))

  def _take(self, n: int, counts: np.ndarray | None) -> np.ndarray:
    """The next n pairs of the current document, as a view of n+1 tokens; they count towards their source in
    `counts` (the sequence's per-source pairs), so counting costs one add per piece, not per token."""
    piece = self._doc[self._offset:self._offset + n + 1]
    self._offset += n
    if counts is not None:
      counts[self._source] += n
    return piece

  def _new_counts(self) -> np.ndarray | None:
    return np.zeros(self._sources, np.int64) if self._sources else None

  def _fill_round(self) -> None:
    self._round_start = (self._doc_state, self._offset) if self._doc is not None else (self._parent.get_state(), 0)
    bins: list[list[np.ndarray]] = []
    counts: list[np.ndarray | None] = []
    if self._method == "concat":
      room = self._seq_len
      pieces: list[np.ndarray] = []
      counts = [self._new_counts()]
      while room and (n := self._peek()):
        if not pieces:
          self._round_start = (self._doc_state, self._offset)
        pieces.append(self._take(min(n, room), counts[0]))
        room -= len(pieces[-1]) - 1
      bins = [pieces] if pieces else []
    else:
      rooms: list[int] = []
      while n := self._peek():
        # Round start is re-read here: documents with no pairs may have been skipped before the first piece.
        if not bins:
          self._round_start = (self._doc_state, self._offset)
        i = next((i for i, r in enumerate(rooms) if r >= n), -1)
        if i < 0:
          if len(bins) == self._bins:
            break
          bins.append([])
          rooms.append(self._seq_len)
          counts.append(self._new_counts())
        bins[i].append(self._take(n, counts[i]))
        rooms[i] -= n
    self._round, self._counts, self._emitted = bins, counts, 0

  def __next__(self) -> dict[str, np.ndarray]:
    if self._emitted == len(self._round):
      self._fill_round()
      if not self._round:
        raise StopIteration
    pieces, counts = self._round[self._emitted], self._counts[self._emitted]
    self._emitted += 1
    out = write_sequence(pieces, self._seq_len)
    if counts is not None:
      out[SOURCE_TOKENS] = counts
    return out

  def get_state(self) -> dict[str, Any]:
    # The cursor: where the next round starts. `next` keeps it mid-round too, where a stage of another length
    # continues (maxctx.data.Pipeline.restore, carry=True), leaving the round's unsent sequences unused.
    cursor = (self._doc_state, self._offset) if self._doc is not None else (self._parent.get_state(), 0)
    if self._emitted == len(self._round):  # Between rounds
      return {"parent": cursor[0], "offset": cursor[1], "emitted": 0, "next": self._cursor(cursor)}
    return {"parent": self._round_start[0], "offset": self._round_start[1], "emitted": self._emitted,
            "next": self._cursor(cursor)}

  def _cursor(self, cursor) -> dict[str, Any]:
    # With a mixture, the source of the document in progress: re-reading it must not pick another source.
    out = {"parent": cursor[0], "offset": cursor[1]}
    if self._sources and self._doc is not None:
      out["source"] = self._source
    return out

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._reset(state["parent"], 0)
    if state["offset"] or state["emitted"]:
      # Re-read the document the round began in; an offset inside it is where the round's first piece starts.
      self._peek()
      self._offset = state["offset"]
    if state["emitted"]:
      self._fill_round()
      self._emitted = state["emitted"]


class PackIterDataset(grain.IterDataset):
  """Packs a parent of 1-D int32 documents (whole documents, BOS/EOS included) into dicts of FIELDS [seq_len]."""

  def __init__(self, parent: grain.IterDataset, seq_len: int, method: Literal["first_fit", "concat"] = "first_fit",
               long_documents: Literal["split", "truncate"] = "split", bins: int | None = None,
               max_empty: int | None = None, starved: str = "", sources: int = 0):
    """`max_empty`: more documents than this in a row without a pair raise a DataError (`starved`, where {n} is
    their number) instead of reading on forever. `sources` > 0: the parent gives (document, source index) pairs
    (a mixture of that many sources) and each sequence adds SOURCE_TOKENS."""
    super().__init__(parent)
    if method not in ("first_fit", "concat"):
      raise ValueError(f"unknown packing method {method!r}")
    self._args = (seq_len, method, long_documents, bins or default_bins(seq_len), max_empty, starved, sources)

  def __iter__(self) -> _PackIterator:
    return _PackIterator(self._parent.__iter__(), *self._args)

  def __str__(self) -> str:
    return f"PackIterDataset(seq_len={self._args[0]}, method={self._args[1]}, long_documents={self._args[2]})"
