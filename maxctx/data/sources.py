"""Document sources: random-access (`len`, `[i]`) over local files, as grain's MapDataset.source expects.

A record is a document: `str` (to be tokenized) or a 1-D int32 array (pre-tokenized), or None for a record that
`data.bad_records=skip` dropped. Each source indexes its files once, at build time (logging progress on long scans),
so errors about paths and empty corpora come before anything compiles; records are read lazily, by offset.

  stdlib       the Python standard library's .py files, one file one document, sorted by path (the demo corpus:
               the same on every machine with the same Python version, nothing to download)
  text         files matched by data.path; one file one document, or split at data.text_separator
  jsonl        one JSON object per line; data.text_field holds text, or a list of token ids without a tokenizer
  arrayrecord  ArrayRecord files; a record is UTF-8 text, or little-endian int32 token ids without a tokenizer
  tfds         a prepared TFDS dataset directory, read with tfds' data source (never downloads): data.path is
               DIR or DIR:SPLIT (default train)
"""

from __future__ import annotations

import glob
import json
import logging
import os
import pathlib
import sysconfig
import time
from typing import Any, Callable

import numpy as np

from maxctx.errors import ConfigError, DataError

log = logging.getLogger("maxctx.data")

_BLOCK = 1 << 26  # Bytes read at a time while indexing.


def expand(path_spec: str, key: str = "data.path") -> list[str]:
  """Files named by data.path (or `key`): comma-separated files, directories (every file below) or glob patterns (**
  works)."""
  if not path_spec.strip():
    raise ConfigError(f"{key} is empty; set it to the files to read (a file, a directory or a glob).")
  files: list[str] = []
  for part in (p.strip() for p in path_spec.split(",")):
    p = os.path.expanduser(part)
    if os.path.isdir(p):
      found = sorted(str(f) for f in pathlib.Path(p).rglob("*") if f.is_file() and not f.name.startswith("."))
    elif glob.has_magic(p):
      found = sorted(f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
    else:
      found = [p] if os.path.isfile(p) else []
    if not found:
      what = ("matches no files" if glob.has_magic(p) else "is an empty directory" if os.path.isdir(p)
              else "does not exist")
      raise DataError(f"{key} {part!r} {what} (relative paths are from {os.getcwd()}); check the path or pattern.")
    files += found
  return files


def stdlib_files() -> list[pathlib.Path]:
  """The standard library's .py files, sorted by relative path; installed packages (site-packages) are not stdlib."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = [p for p in root.rglob("*.py")
           if not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts) and p.is_file()]
  return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_text(path: str | os.PathLike) -> str:
  # `replace`, not an error: only for the stdlib corpus, where a few test files are deliberately mis-encoded and the
  # corpus must still load. A user's text that is not UTF-8 is a bad record (`_decode`).
  with open(path, "rb") as f:
    return f.read().decode("utf-8", errors="replace")


def _decode(data: bytes, where: Callable[[int], str], bad: _Bad) -> str | None:
  """UTF-8 text, or the bad-record policy's answer naming where the first undecodable byte is."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    return bad(where(e.start), f"is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); decode it to "
               "UTF-8 first")


class _Progress:
  """Logs a line every few seconds during a long scan, so a large corpus never looks hung."""

  def __init__(self, what: str, total_files: int):
    self._what, self._total, self._start, self._last = what, total_files, time.monotonic(), time.monotonic()

  def __call__(self, done_files: int, records: int) -> None:
    if time.monotonic() - self._last > 5:
      self._last = time.monotonic()
      log.info("indexing %s: %d/%d files, %d documents (%.0fs)", self._what, done_files, self._total, records,
               self._last - self._start)


class _Bad:
  """The `data.bad_records` policy: error names the record; skip counts, logs and drops it, once per record however
  many epochs read it again."""

  def __init__(self, policy: str):
    self.policy, self.skipped = policy, 0
    self.first = ""  # The first record dropped, and why, for a message saying that nothing usable is left.
    self._seen: set[str] = set()

  def __call__(self, where: str, why: str) -> None:
    if self.policy == "error":
      raise DataError(f"{where} {why}; fix or remove the record, or set data.bad_records=skip to drop such records.")
    if where in self._seen:
      return
    self._seen.add(where)
    self.skipped += 1
    self.first = self.first or f"{where} {why}"
    log.warning("data.bad_records=skip: dropped %s (%s); %d dropped so far", where, why, self.skipped)


class Files:
  """Text files: one document per file, or documents between occurrences of a separator."""

  def __init__(self, files: list[str], separator: str = "", describe: str = "data.path", bad: _Bad | None = None):
    # Without `bad` (the stdlib corpus) undecodable bytes are replaced; see read_text.
    self.files, self._bad = [str(f) for f in files], bad
    sizes = np.array([os.path.getsize(f) for f in self.files], np.int64)
    if not separator:
      keep = np.flatnonzero(sizes > 0)
      self._file, self._start, self._len = keep, np.zeros(len(keep), np.int64), sizes[keep]
    else:
      self._index(separator.encode())
    if not len(self._file):
      raise DataError(f"{describe} holds no documents ({len(self.files)} files, all empty); point data.path at "
                      "files with text.")

  def _index(self, sep: bytes) -> None:
    # Whole files are read once here; documents are then read by offset. Files are taken whole (a separator may
    # straddle any block boundary), which is fine for files up to a few GB.
    file_ix, starts, lens = [], [], []
    progress = _Progress("text", len(self.files))
    for i, path in enumerate(self.files):
      with open(path, "rb") as f:
        data = f.read()
      pos = 0
      while pos <= len(data):
        end = data.find(sep, pos)
        end = len(data) if end < 0 else end
        if data[pos:end].strip():
          file_ix.append(i)
          starts.append(pos)
          lens.append(end - pos)
        pos = end + len(sep)
      progress(i + 1, len(starts))
    self._file = np.array(file_ix, np.int64)
    self._start, self._len = np.array(starts, np.int64), np.array(lens, np.int64)

  def __len__(self) -> int:
    return len(self._file)

  def __getitem__(self, i: int) -> str | None:
    path, start = self.files[self._file[i]], int(self._start[i])
    with open(path, "rb") as f:
      f.seek(start)
      data = f.read(self._len[i])
    if self._bad is None:
      return data.decode("utf-8", errors="replace")
    return _decode(data, lambda at: f"{path} line {self._line_of(path, start + at)}", self._bad)

  @staticmethod
  def _line_of(path: str, offset: int) -> int:
    with open(path, "rb") as f:
      return f.read(offset).count(b"\n") + 1


class Jsonl:
  """JSON Lines: each non-blank line one document, its `field` text (or token ids when there is no tokenizer)."""

  def __init__(self, files: list[str], field: str, tokens: bool, bad: _Bad):
    self.files, self._field, self._tokens, self._bad = files, field, tokens, bad
    file_ix, starts, lens = [], [], []
    progress = _Progress("jsonl", len(files))
    for i, path in enumerate(files):
      with open(path, "rb") as f:
        offset, line_start = 0, 0
        while block := f.read(_BLOCK):
          ends = offset + np.flatnonzero(np.frombuffer(block, np.uint8) == ord("\n"))
          line_starts = np.concatenate([[line_start], ends[:-1] + 1]) if len(ends) else np.zeros(0, np.int64)
          starts.append(line_starts)
          lens.append(ends - line_starts)
          file_ix.append(np.full(len(ends), i))
          if len(ends):
            line_start = int(ends[-1]) + 1
          offset += len(block)
        if offset > line_start:  # A last line without a newline.
          starts.append(np.array([line_start]))
          lens.append(np.array([offset - line_start]))
          file_ix.append(np.array([i]))
      progress(i + 1, sum(len(s) for s in starts))
    cat = lambda parts: np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    self._file, self._start, self._len = cat(file_ix), cat(starts), cat(lens)
    # Line numbers for messages: the index of a line within its file, 1-based.
    keep = self._len > 0
    first = np.searchsorted(self._file, np.arange(len(files)))
    self._line = np.arange(len(self._file)) - first[self._file] + 1 if len(self._file) else self._file
    self._file, self._start, self._len, self._line = (a[keep] for a in (self._file, self._start, self._len, self._line))
    if not len(self._file):
      raise DataError(f"data.path {', '.join(files[:3])}{' ...' if len(files) > 3 else ''} holds no JSON lines "
                      f"({len(files)} files, all empty); point data.path at JSONL files with records.")

  def __len__(self) -> int:
    return len(self._file)

  def __getitem__(self, i: int) -> str | np.ndarray | None:
    path = self.files[self._file[i]]
    with open(path, "rb") as f:
      f.seek(self._start[i])
      line = f.read(self._len[i])
    where = f"{path} line {self._line[i]}"
    if not line.strip():
      return None
    text = _decode(line, lambda at: where, self._bad)
    if text is None:
      return None
    try:
      record = json.loads(text)
    except ValueError as e:
      return self._bad(where, f"is not JSON ({e.msg} at column {e.colno})")
    if not isinstance(record, dict) or self._field not in record:
      keys = ", ".join(list(record)[:5]) if isinstance(record, dict) else type(record).__name__
      return self._bad(where, f"has no field {self._field!r} (it has: {keys}); set data.text_field to the field "
                       "that holds the text")
    return _value(record[self._field], self._tokens, where, self._bad)


def _value(value: Any, tokens: bool, where: str, bad: _Bad) -> str | np.ndarray | None:
  if isinstance(value, bytes) and not tokens:
    value = _decode(value, lambda at: where, bad)
    if value is None:
      return None
  if tokens:
    try:
      arr = np.asarray(value)
    except ValueError:
      arr = None
    if arr is None or arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
      return bad(where, "holds no list of token ids (data.tokenizer is empty, so records must be pre-tokenized)")
    return arr.astype(np.int32)
  if not isinstance(value, str):
    return bad(where, f"holds a {type(value).__name__}, not text (set data.tokenizer only for text records)")
  return value


class ArrayRecord:
  """ArrayRecord files via grain's data source: UTF-8 text, or int32 little-endian token ids."""

  def __init__(self, files: list[str], tokens: bool, bad: _Bad):
    import grain
    self._tokens, self._bad = tokens, bad
    try:
      self._source = grain.sources.ArrayRecordDataSource(files)
    except Exception as e:  # array_record raises plain exceptions for files that are not ArrayRecord.
      raise DataError(f"data.path {files[0]}{' ...' if len(files) > 1 else ''} cannot be read as ArrayRecord "
                      f"({e}); check data.source and the files.") from None
    if not len(self._source):
      raise DataError(f"data.path {files[0]}{' ...' if len(files) > 1 else ''} holds no records; point data.path "
                      "at ArrayRecord files with records.")

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i: int) -> str | np.ndarray | None:
    record = self._source[i]
    if not self._tokens:
      return _decode(record, lambda at: f"arrayrecord record {i}", self._bad)
    if len(record) % 4:
      return self._bad(f"arrayrecord record {i}", f"has {len(record)} bytes, not a whole number of int32 token ids")
    return np.frombuffer(record, "<i4").astype(np.int32)


class Tfds:
  """A prepared TFDS dataset directory (`DIR` or `DIR:SPLIT`), read record by record; nothing is downloaded."""

  def __init__(self, spec: str, field: str, tokens: bool, bad: _Bad):
    try:
      import tensorflow_datasets as tfds
    except ImportError:
      raise ConfigError("data.source=tfds needs tensorflow-datasets; install the extra with "
                        "`pip install -e .[tfds]`, or use another data.source.") from None
    directory, _, split = spec.partition(":")
    if not os.path.isdir(os.path.expanduser(directory)):
      raise DataError(f"data.path {directory!r} is not a directory; give a prepared TFDS dataset directory "
                      "(…/name/version), optionally with :split.")
    self._field, self._tokens, self._bad = field, tokens, bad
    self._source = tfds.builder_from_directory(os.path.expanduser(directory)).as_data_source(split=split or "train")
    if not len(self._source):
      raise DataError(f"data.path {spec!r} holds no records in split {split or 'train'!r}; check the split.")

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i: int) -> str | np.ndarray | None:
    record = self._source[i]
    where = f"tfds record {i}"
    if self._field not in record:
      return self._bad(where, f"has no field {self._field!r} (it has: {', '.join(record)}); set data.text_field")
    return _value(record[self._field], self._tokens, where, self._bad)


def open_source(data, has_tokenizer: bool, key: str = "data.path"):
  """The source for `data` (a DataConfig, or one mixture entry's view of it), and its bad-record counter; `key` names
  the path in errors."""
  bad = _Bad(data.bad_records)
  start = time.monotonic()
  if data.source == "stdlib":
    files = stdlib_files()
    src = Files([str(f) for f in files], describe=f"the standard library at {sysconfig.get_paths()['stdlib']}")
  elif data.source == "text":
    if not has_tokenizer:
      raise ConfigError("data.source=text reads text, so it needs data.tokenizer (a SentencePiece .model or Llama 3 "
                        "tokenizer.model; python -m maxctx.train_tokenizer trains one).")
    src = Files(expand(data.path, key), getattr(data, "text_separator", ""), bad=bad)
  elif data.source == "jsonl":
    src = Jsonl(expand(data.path, key), data.text_field, not has_tokenizer, bad)
  elif data.source == "arrayrecord":
    src = ArrayRecord(expand(data.path, key), not has_tokenizer, bad)
  elif data.source == "tfds":
    src = Tfds(data.path, data.text_field, not has_tokenizer, bad)
  else:   # the schema admits only the sources maxctx.data.dataset and this function open
    raise ValueError(f"data.source {data.source!r} has no reader here")
  log.info("%s (%s): %d documents (indexed in %.1fs)", key, data.source, len(src), time.monotonic() - start)
  return src, bad
