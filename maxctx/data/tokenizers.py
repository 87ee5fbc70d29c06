"""Tokenizers: SentencePiece `.model` files and Llama 3's `tokenizer.model` (tiktoken BPE ranks), plus training a
small SentencePiece model on local text (the demo's, cached on first use).

A document becomes `[BOS] + ids + [EOS]` (each where the tokenizer has one), so the model learns where documents
start and end and the packer never needs to know the tokenizer.

Llama 3's file is a tiktoken ranks file: one `base64(token bytes) rank` per line, 128,000 lines. Its 256 special tokens
follow the ranks: BOS 128000 `<|begin_of_text|>`, EOS 128001 `<|end_of_text|>`, ... (vocabulary 128,256). A smaller
ranks file of n entries gets the same layout from n: BOS n, EOS n+1, vocabulary n+256.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import os
import pathlib
import sys
import sysconfig
import time
from typing import Iterable, Iterator

import numpy as np

from maxctx.errors import ConfigError, DataError

log = logging.getLogger("maxctx.data")

# Llama 3's pre-tokenizer split (from its reference tokenizer): contractions, words, 1–3 digit runs, punctuation runs,
# newlines, spaces.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NUM_SPECIAL = 256
LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")


class SentencePiece:

  def __init__(self, path: str, proto: bytes):
    import sentencepiece as spm
    self.path, self._proto = path, proto
    self._sp = spm.SentencePieceProcessor(model_proto=proto)
    self.vocab_size = self._sp.vocab_size()
    self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
    self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def decode(self, ids: Iterable[int]) -> str:
    return self._sp.decode(list(ids))

  def __reduce__(self):  # grain worker processes receive the model bytes, not a C++ object.
    return SentencePiece, (self.path, self._proto)


class Tiktoken:

  def __init__(self, path: str, ranks: dict[bytes, int]):
    import tiktoken
    self.path, self._ranks = path, ranks
    n = len(ranks)
    names = list(LLAMA3_SPECIAL) + [f"<|reserved_special_token_{i}|>"
                                    for i in range(2, 2 + LLAMA3_NUM_SPECIAL - len(LLAMA3_SPECIAL))]
    self._enc = tiktoken.Encoding(pathlib.Path(path).name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                  special_tokens={s: n + i for i, s in enumerate(names)})
    self.vocab_size = n + LLAMA3_NUM_SPECIAL
    self.bos_id, self.eos_id = n, n + 1

  def encode(self, text: str) -> list[int]:
    # Special-token text inside a document is data, not control: encode it as ordinary bytes.
    return self._enc.encode(text, disallowed_special=())

  def decode(self, ids: Iterable[int]) -> str:
    return self._enc.decode(list(ids))

  def __reduce__(self):
    return Tiktoken, (self.path, self._ranks)


Tokenizer = SentencePiece | Tiktoken


def _read_ranks(path: str, data: bytes) -> dict[bytes, int] | None:
  """The ranks of a tiktoken file, or None if `data` does not look like one."""
  try:
    lines = data.decode("ascii").split("\n")
  except UnicodeDecodeError:
    return None
  ranks = {}
  for i, line in enumerate(lines):
    if not line:
      continue
    parts = line.split(" ")
    try:
      token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
    except (ValueError, IndexError):
      if i == 0:
        return None
      raise DataError(f"data.tokenizer {path} line {i + 1} is not `base64-token rank`; the tiktoken ranks file is "
                      "corrupt, replace it.") from None
    ranks[token] = rank
  if sorted(ranks.values()) != list(range(len(ranks))):
    raise DataError(f"data.tokenizer {path} has ranks that are not 0..{len(ranks) - 1} without gaps; the tiktoken "
                    "ranks file is corrupt, replace it.")
  return ranks


# The largest tokenizer file read: Llama 3's is 2 MB, SentencePiece models of 256K pieces a few MB. A bigger file is
# data given by mistake, and reading it whole would only exhaust memory.
MAX_TOKENIZER_BYTES = 256 * 2**20
_WHAT = "a SentencePiece .model or Llama 3 tokenizer.model (python -m maxctx.train_tokenizer trains one)"


def _read(path: str) -> bytes:
  """The bytes of the tokenizer file at `path`; DataError naming the path when it is no file a tokenizer can be."""
  p = pathlib.Path(path).expanduser()
  if p.is_dir():
    inside = p / "tokenizer.model"
    hint = f"; did you mean {inside}?" if inside.is_file() else f"; give the path of {_WHAT}."
    raise DataError(f"data.tokenizer {path} is a directory, not a tokenizer file{hint}")
  if not p.exists():
    raise DataError(f"data.tokenizer {path} does not exist; give the path of {_WHAT}.")
  if not p.is_file():
    raise DataError(f"data.tokenizer {path} is not a regular file (a device, pipe or socket); give the path of "
                    f"{_WHAT}.")
  try:
    with p.open("rb") as f:
      data = f.read(MAX_TOKENIZER_BYTES + 1)
  except OSError as e:
    raise DataError(f"data.tokenizer {path} cannot be read ({e.strerror}); make it readable by this user or give "
                    f"another path.") from None
  if not data:
    raise DataError(f"data.tokenizer {path} is an empty file (an interrupted download or copy?); replace it with "
                    f"{_WHAT}.")
  if len(data) > MAX_TOKENIZER_BYTES:
    raise DataError(f"data.tokenizer {path} is larger than {MAX_TOKENIZER_BYTES // 2**20} MiB, far more than any "
                    f"tokenizer; is it a data file? Give the path of {_WHAT}.")
  return data


def load(path: str) -> Tokenizer:
  """A SentencePiece model or tiktoken ranks file; DataError naming the path, in one sentence, if it is missing, a
  directory, unreadable, empty or of another format."""
  data = _read(path)
  ranks = _read_ranks(path, data)
  if ranks:
    return Tiktoken(str(pathlib.Path(path).expanduser()), ranks)
  try:
    tok = SentencePiece(str(pathlib.Path(path).expanduser()), data)
  except RuntimeError:
    tok = None
  if tok is None or tok.vocab_size == 0:  # A protobuf with no pieces parses, then fails on the first encode.
    hint = " (a Hugging Face tokenizer.json is not read; use the model's tokenizer.model)" \
        if data.lstrip()[:1] == b"{" else ""
    raise DataError(f"data.tokenizer {path} is neither a SentencePiece model nor a tiktoken BPE ranks file{hint}; "
                    "the file is corrupt or of another kind, replace it.")
  return tok


def check_fits(tokenizer: Tokenizer, vocab_size: int) -> None:
  if tokenizer.vocab_size > vocab_size:
    raise ConfigError(f"data.tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but model.vocab_size is "
                      f"{vocab_size}; raise model.vocab_size to at least {tokenizer.vocab_size} or use a smaller "
                      "tokenizer.")


def encode_document(tokenizer: Tokenizer, text: str) -> np.ndarray:
  ids = tokenizer.encode(text) if text else []
  if not ids:
    return np.zeros(0, np.int32)
  head = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
  tail = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
  return np.asarray(head + ids + tail, np.int32)


# ---------------------------------------------------------------------------------------------------------------------
# Training.


def _chunks(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
  """Texts cut at line ends into pieces of at most ~max_bytes: SentencePiece skips longer sentences."""
  count, start, last = 0, time.monotonic(), time.monotonic()
  for text in texts:
    buf: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
      if size + len(line) > max_bytes and buf:
        yield "".join(buf)
        buf, size = [], 0
      buf.append(line[:max_bytes])
      size += len(buf[-1])
    if buf:
      yield "".join(buf)
    count += 1
    if time.monotonic() - last > 5:
      log.info("tokenizer training: read %d documents (%.0fs)", count, time.monotonic() - start)
      last = time.monotonic()


def train_sentencepiece(texts: Iterable[str], output: str | os.PathLike, vocab_size: int, *,
                        model_type: str = "bpe", max_sentences: int = 0) -> pathlib.Path:
  """Trains a SentencePiece model that keeps text as it is (code: indentation, newlines, tabs) and writes it atomically.

  max_sentences > 0 samples that many ~2 KB chunks; 0 uses all (deterministic for the same input).
  """
  import sentencepiece as spm
  output = pathlib.Path(output)
  output.parent.mkdir(parents=True, exist_ok=True)
  start = time.monotonic()
  log.info("training a %d-token SentencePiece %s model into %s", vocab_size, model_type, output)
  proto = io.BytesIO()
  # Newline and tab are single pieces: SentencePiece trains on lines and would otherwise map them to <unk>.
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=_chunks(texts, 2000), model_writer=proto, vocab_size=vocab_size, model_type=model_type,
        character_coverage=0.9995, normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True, user_defined_symbols=["\n", "\t"],
        input_sentence_size=max_sentences, shuffle_input_sentence=max_sentences > 0, max_sentence_length=4096,
        num_threads=os.cpu_count() or 1, minloglevel=2)
  except RuntimeError as e:
    raise DataError(f"training a {vocab_size}-token tokenizer for {output} failed ({str(e).strip()}); use a smaller "
                    "vocabulary or more text.") from None
  tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
  tmp.write_bytes(proto.getvalue())
  os.replace(tmp, output)
  log.info("tokenizer trained in %.1fs: %s", time.monotonic() - start, output)
  return output


def cache_dir() -> pathlib.Path:
  """$MAXCTX_CACHE, else $XDG_CACHE_HOME/maxctx, else ~/.cache/maxctx."""
  if os.environ.get("MAXCTX_CACHE"):
    return pathlib.Path(os.environ["MAXCTX_CACHE"])
  return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "maxctx"


def stdlib_tokenizer(vocab_size: int) -> Tokenizer:
  """The demo's tokenizer: a SentencePiece model of `vocab_size` trained on the standard library, cached under a
  digest of the files it is trained on.

  Two installations of one Python version can hold different standard libraries (a distribution's trimmed one, a
  patch release): a cache keyed by the version alone would hand one of them the other's tokenizer."""
  from maxctx.data import sources  # Here, not at the top: sources imports nothing from tokenizers, keep it so.
  v = sys.version_info
  files = sources.stdlib_files()
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  digest = hashlib.sha256()
  for f in files:
    data = f.read_bytes()
    digest.update(f"{f.relative_to(root).as_posix()}\0{len(data)}\0".encode())
    digest.update(data)
  path = cache_dir() / "tokenizers" / f"stdlib-py{v.major}.{v.minor}-{digest.hexdigest()[:12]}-bpe{vocab_size}.model"
  if not path.exists():
    if vocab_size < 300:
      raise ConfigError(f"model.vocab_size {vocab_size} is too small for the standard-library tokenizer; use at "
                        "least 300 (the demo uses 512).")
    log.info("training the demo tokenizer on the %d files of the standard library at %s", len(files), root)
    train_sentencepiece((sources.read_text(f) for f in files), path, vocab_size)
  return load(str(path))
