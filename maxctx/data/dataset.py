"""The grain dataset of one process: its rows of every global batch, packed and laid out for the mesh.

Row r of every global batch comes from its own stream: documents r, r+B, r+2B, ... of the (seeded, per-epoch)
shuffled corpus, tokenized and packed on their own. So a row is the same whichever process makes it, a process makes
only the rows its devices hold, and the global batch is the same for any number of processes.

  source ─shuffle, repeat, [r::B]─ encode ─ pack ─┐
  ...                                             ├─ zip ─ stack, zigzag ─ (prefetch) → {field: [rows, seq_len]}
  source ─shuffle, repeat, [r'::B]─ encode ─ pack ┘

With data.mixture each row mixes its own slice [r::B] of every source before packing (maxctx.data.mixture).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import grain
import numpy as np

from maxctx.attention import layout
from maxctx.config import Config
from maxctx.data import mixture, packing, sources, synthetic, task_rows, tasks, tokenizers
from maxctx.errors import ConfigError, DataError

log = logging.getLogger("maxctx.data")

# Documents read ahead per row stream: the packer pulls them one at a time, threads would only contend for the GIL.
_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


class Encode(grain.transforms.Map):
  """A record → the int32 document the packer takes: tokenized text, or checked token ids; empty if skipped.

  With `records` (the source's size), a source none of whose first `records` reads gave a document is an error: the
  packer would otherwise read it round and round forever, waiting for a token.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer | None, vocab_size: int, records: int | None = None,
               bad=None, key: str = "data.path"):
    self._tokenizer, self._vocab_size = tokenizer, vocab_size
    self._records, self._bad, self._key = records, bad, key
    self._read, self._usable = 0, 0

  def map(self, record):
    doc = self._encode(record)
    self._read += 1
    self._usable += len(doc) >= 2
    if self._records and not self._usable and self._read >= self._records:
      first = f" (the first: {self._bad.first})" if self._bad is not None and self._bad.first else ""
      raise DataError(f"{self._key} yields no usable document: none of its {self._records} records gave two tokens "
                      f"or more{first}; fix the data (or its text_field), or point {self._key} at other files.")
    return doc

  def _encode(self, record):
    if record is None:
      return np.zeros(0, np.int32)
    if isinstance(record, str):
      return tokenizers.encode_document(self._tokenizer, record)
    if record.size and (record.min() < 0 or record.max() >= self._vocab_size):
      bad = int(record.max()) if record.max() >= self._vocab_size else int(record.min())
      raise DataError(f"a pre-tokenized document holds token id {bad}, outside model.vocab_size {self._vocab_size}; "
                      "set model.vocab_size to the tokenizer's vocabulary or fix the data.")
    return record


# Training a SentencePiece model on the standard library is quick only for small vocabularies: the largest the demo's
# model is trained to when text must be written without data.tokenizer.
MAX_STDLIB_VOCAB = 32768


def tokenizer_for(config: Config, writes_text: bool = False) -> tokenizers.Tokenizer | None:
  """The run's tokenizer, checked against model.vocab_size: data.tokenizer, else the demo's SentencePiece model of the
  run's vocabulary for the stdlib source, or wherever text is written (generated tasks, the eval), else None
  (token-id data needs none)."""
  d, vocab = config.data, config.model.vocab_size
  if d.tokenizer:
    tok = tokenizers.load(d.tokenizer)
  elif "stdlib" in (d.source, *(m.source for m in d.mixture)) or (writes_text and vocab <= MAX_STDLIB_VOCAB):
    tok = tokenizers.stdlib_tokenizer(vocab)
  elif writes_text:
    raise ConfigError(f"generated text needs a tokenizer, but this run has no data.tokenizer and model.vocab_size "
                      f"{vocab} is too large to train one here; set data.tokenizer to the model's tokenizer file.")
  else:
    return None
  tokenizers.check_fits(tok, vocab)
  return tok


class _NoNones:
  """The source with each dropped record (None) as an empty document: grain filters a None out before Encode sees
  it, so a source whose every record is dropped would be read round and round in silence."""

  def __init__(self, source):
    self._source = source

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i):
    record = self._source[i]
    return np.zeros(0, np.int32) if record is None else record


def _documents(source, config: Config, encode: Encode, seed: int) -> grain.MapDataset:
  """The source's documents, shuffled (seeded), repeated forever, encoded, and thinned for up-sampling."""
  d = config.data
  docs = grain.MapDataset.source(_NoNones(source))
  if d.shuffle:
    # index_shuffle reseeds per epoch (seed + epoch), so repeated epochs come in new orders.
    docs = docs.shuffle(seed=seed % 2**32)
  docs = docs.repeat(None).map(encode)
  if weight := mixture.upsampling(d):
    docs = docs.random_map(mixture.Upsample(d.long_threshold, weight), seed=seed % 2**32)
  return docs


def _packed(stream: grain.IterDataset, config: Config, r: int, max_empty: int, path_key: str) -> grain.IterDataset:
  # A row that reads its whole share of the corpus many times over without a usable document never fills; stop
  # instead of spinning (possible only when almost every record is dropped or empty).
  d = config.data
  starved = (f"row {r} of the batch read {{n}} documents in a row without a usable one (dropped under "
             f"data.bad_records=skip, empty, or a single token); {path_key} holds too few usable documents for "
             f"data.batch_size {d.batch_size}: fix the data or use a smaller batch.")
  return packing.PackIterDataset(stream, d.seq_len, d.packing, d.long_documents,
                                 max_empty=max(max_empty, d.batch_size) * mixture.empty_allowance(d), starved=starved,
                                 sources=len(d.mixture))


def _rows_of_documents(source, config: Config, encode: Encode, rows: Sequence[int]) -> list[grain.IterDataset]:
  docs, b = _documents(source, config, encode, config.run.seed), config.data.batch_size
  return [_packed(docs[r::b].to_iter_dataset(_READ), config, r, len(source), "data.path") for r in rows]


def _rows_of_mixture(config: Config, tok, rows: Sequence[int]) -> tuple[list[grain.IterDataset], list]:
  d = config.data
  docs, bads, records = [], [], 0
  for i, m in enumerate(d.mixture):
    key = f"data.mixture[{i}].path"
    entry = dataclasses.replace(d, source=m.source, path=m.path, text_field=m.text_field,
                                text_separator=m.text_separator)
    source, bad = sources.open_source(entry, has_tokenizer=tok is not None, key=key)
    encode = Encode(tok, config.model.vocab_size, len(source), bad, key)
    docs.append(_documents(source, config, encode, mixture.source_seed(config.run.seed, i)))
    bads.append(bad)
    records += len(source)
  truncate_at = d.seq_len if d.long_documents == "truncate" else None
  weights = [m.weight for m in d.mixture]
  streams = [_packed(mixture.MixIterDataset([s[r::d.batch_size].to_iter_dataset(_READ) for s in docs], weights,
                                            truncate_at), config, r, records, "data.mixture")
             for r in rows]
  return streams, bads


class _Skipped:
  """The mixture's bad-record counters as one."""

  def __init__(self, bads: list):
    self._bads = bads

  @property
  def skipped(self) -> int:
    return sum(b.skipped for b in self._bads)


def _rows_of_synthetic(config: Config, rows: Sequence[int]) -> list[grain.IterDataset]:
  d, seed, vocab = config.data, config.run.seed, config.model.vocab_size
  steps = grain.MapDataset.range(1 << 62)
  return [steps.map(lambda i, r=r: synthetic.row(seed, i, r, d.seq_len, vocab)).to_iter_dataset(_READ) for r in rows]


def _rows_of_task(config: Config, rows: Sequence[int]) -> list[grain.IterDataset]:
  # Generated task rows (the demos): the eval's own examples at the training length.
  pieces = tasks.Pieces(tokenizer_for(config, writes_text=True))
  d, seed = config.data, config.run.seed
  if d.source == "passkey" and (d.task != "passkey" or d.task_min_len):
    raise ConfigError(f"data.source is passkey, which ignores data.task ({d.task}) and data.task_min_len "
                      f"({d.task_min_len}); set data.source: task to train on them.")
  task = d.task if d.source == "task" else "passkey"
  tasks.check_tasks([task], "data.task")
  tasks.generate(task, pieces, d.seq_len, 0.0, 0)  # refuses a data.seq_len too short for one, before compiling
  min_len = d.task_min_len if d.source == "task" else 0
  if min_len:
    if min_len > d.seq_len:
      raise ConfigError(f"data.task_min_len is {min_len} but data.seq_len is {d.seq_len}; set data.task_min_len to at "
                        f"most the sequence length (0 makes one example per row).")
    try:
      tasks.generate(task, pieces, min_len, 0.0, 0)
    except ConfigError as e:
      raise ConfigError(f"data.task_min_len {min_len} is too short: {e}") from None
  steps = grain.MapDataset.range(1 << 62)
  return [steps.map(lambda i, r=r: task_rows.row(task, pieces, seed, i, r, d.seq_len, min_len)).to_iter_dataset(_READ)
          for r in rows]


class Stack(grain.transforms.Map):
  """Row dicts → one dict of [rows, seq_len] arrays, zigzagged over `context` when load balancing."""

  def __init__(self, context: int | None):
    self._context = context

  def map(self, row_dicts):
    out = {k: np.stack([r[k] for r in row_dicts]) for k in packing.FIELDS}
    if self._context:
      out = {k: layout.zigzag(v, self._context, axis=1) for k, v in out.items()}
    if packing.SOURCE_TOKENS in row_dicts[0]:   # host-only, [rows, sources]: summed, not laid out
      out[packing.SOURCE_TOKENS] = np.stack([r[packing.SOURCE_TOKENS] for r in row_dicts])
    return out


def local_dataset(config: Config, rows: Sequence[int], context: int) -> tuple[grain.IterDataset, object]:
  """This process's batches as a grain IterDataset, and the source's bad-record counter (None for synthetic)."""
  d = config.data
  if d.source == "synthetic":
    streams, bad = _rows_of_synthetic(config, rows), None
  elif d.source in ("passkey", "task"):
    streams, bad = _rows_of_task(config, rows), None
  elif d.source == "mixture":
    streams, bads = _rows_of_mixture(config, tokenizer_for(config), rows)
    bad = _Skipped(bads)
  else:
    tok = tokenizer_for(config)
    source, bad = sources.open_source(d, has_tokenizer=tok is not None)
    streams = _rows_of_documents(source, config, Encode(tok, config.model.vocab_size, len(source), bad), rows)
  ds = grain.experimental.ZipIterDataset(streams).map(Stack(context if config.attention.load_balance else None))
  if d.num_workers > 0:
    # grain's worker processes read absl flags; maxctx has no absl main to parse them, so take the defaults.
    from absl import flags
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=d.num_workers))
  elif d.prefetch > 0:
    # A thread makes the next batches while the devices run this one; its state is that of the batch last handed
    # out, so checkpoints stay exact.
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=d.prefetch)
  return ds, bad
