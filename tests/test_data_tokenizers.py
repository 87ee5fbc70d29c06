"""Tokenizers: SentencePiece training and loading, the Llama 3 tiktoken layout, and the errors a user can cause."""

import base64
import os
import subprocess
import sys

import numpy as np
import pytest

from maxctx.data import sources, tokenizers
from maxctx.errors import ConfigError, DataError

CODE = "def f(x):\n\treturn x + 1\n\n\nclass A:\n    pass\n"


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory):
  """A 320-token SentencePiece model trained on 60 standard-library files (about a second)."""
  files = sources.stdlib_files()[:60]
  out = tmp_path_factory.mktemp("tok") / "small.model"
  return tokenizers.train_sentencepiece((sources.read_text(f) for f in files), out, 320)


def ranks_file(path, merges=()):
  """A tiktoken ranks file: the 256 bytes, then `merges`, as base64 + rank lines (Llama 3's format)."""
  tokens = [bytes([b]) for b in range(256)] + [m.encode() for m in merges]
  path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
  return path


def test_sentencepiece_keeps_code_as_is(sp_model):
  tok = tokenizers.load(str(sp_model))
  assert isinstance(tok, tokenizers.SentencePiece) and tok.vocab_size == 320
  assert tok.decode(tok.encode(CODE)) == CODE
  doc = tokenizers.encode_document(tok, CODE)
  assert doc.dtype == np.int32 and doc[0] == tok.bos_id and doc[-1] == tok.eos_id
  assert len(tokenizers.encode_document(tok, "")) == 0


def test_tiktoken_ranks_get_llama3_special_layout(tmp_path):
  tok = tokenizers.load(str(ranks_file(tmp_path / "tokenizer.model", ["  ", "de", "def"])))
  assert isinstance(tok, tokenizers.Tiktoken)
  n = 259
  assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (n, n + 1, n + 256)
  ids = tok.encode(CODE + "<|end_of_text|>")
  assert n + 1 not in ids, "special-token text inside a document is data"
  assert tok.decode(ids) == CODE + "<|end_of_text|>"
  assert 258 in tok.encode("def f")  # The merge "def" is used.
  doc = tokenizers.encode_document(tok, "hi")
  assert doc[0] == n and doc[-1] == n + 1


def test_llama3_sized_ranks_file_gives_128000_and_128001(tmp_path):
  merges = [f"t{i}" for i in range(128000 - 256)]
  tok = tokenizers.load(str(ranks_file(tmp_path / "tokenizer.model", merges)))
  assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (128000, 128001, 128256)
  assert tok._enc.encode("<|begin_of_text|>", allowed_special="all") == [128000]


def test_missing_tokenizer_names_the_path(tmp_path):
  with pytest.raises(DataError, match=r"data.tokenizer .*nope.model does not exist"):
    tokenizers.load(str(tmp_path / "nope.model"))


@pytest.mark.parametrize("content", [b"\x00\x01garbage\xff" * 10, b"not a model at all"])
def test_corrupt_tokenizer_names_the_path(tmp_path, content):
  path = tmp_path / "bad.model"
  path.write_bytes(content)
  with pytest.raises(DataError, match=r"bad.model is neither a SentencePiece model nor a tiktoken"):
    tokenizers.load(str(path))


def test_corrupt_ranks_line_names_the_line(tmp_path):
  path = ranks_file(tmp_path / "tokenizer.model")
  path.write_text(path.read_text() + "@@@ not-a-rank\n")
  with pytest.raises(DataError, match=r"tokenizer.model line 257"):
    tokenizers.load(str(path))


def test_vocabulary_larger_than_model_is_refused(sp_model):
  with pytest.raises(ConfigError, match=r"has 320 tokens but model.vocab_size is 256; raise model.vocab_size"):
    tokenizers.check_fits(tokenizers.load(str(sp_model)), 256)


def test_train_tokenizer_script(tmp_path):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i, f in enumerate(sources.stdlib_files()[:40]):
    (corpus / f"{i}.txt").write_text(sources.read_text(f))
  out = tmp_path / "t.model"
  run = subprocess.run([sys.executable, "-m", "maxctx.train_tokenizer", "--vocab-size", "300", "--output", str(out),
                        str(corpus / "*.txt")], capture_output=True, text=True)
  assert run.returncode == 0, run.stderr
  assert "300 tokens" in run.stdout and "training on 40 files" in run.stderr
  bad = subprocess.run([sys.executable, "-m", "maxctx.train_tokenizer", "--vocab-size", "300", "--output", str(out),
                        str(tmp_path / "none*.txt")], capture_output=True, text=True)
  assert bad.returncode == 2 and "Traceback" not in bad.stderr
  assert bad.stderr.strip().startswith("error: ") and "matches no files" in bad.stderr and bad.stderr.count("\n") == 1


def test_tokenizer_files_that_cannot_be_one_are_named_in_one_sentence(tmp_path, sp_model):
  # Each is refused before a document is encoded (an empty file passed SentencePiece's load and crashed in encode).
  (tmp_path / "empty.model").write_bytes(b"")
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "tokenizer.model").write_bytes(sp_model.read_bytes())
  (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
  os.mkfifo(tmp_path / "pipe")
  cases = {"empty.model": "is an empty file", "pipe": "is not a regular file",
           "hf": r"is a directory, not a tokenizer file; did you mean .*hf/tokenizer",
           "tokenizer.json": r"is neither .* \(a Hugging Face tokenizer.json is not read"}
  for name, message in cases.items():
    with pytest.raises(DataError, match=rf"data.tokenizer {tmp_path}/{name} {message}") as e:
      tokenizers.load(str(tmp_path / name))
    assert "\n" not in str(e.value)
  with pytest.raises(DataError, match=r"/proc/sys/vm/drop_caches cannot be read \(Permission denied\)"):
    tokenizers.load("/proc/sys/vm/drop_caches")   # write-only, even for root
