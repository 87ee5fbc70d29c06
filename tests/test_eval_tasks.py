"""Task generators: exact token lengths, the needle at its depth, an answer always in the prompt, determinism."""

import base64
import collections
import re

import numpy as np
import pytest

from maxctx.data import tokenizers
from maxctx.errors import ConfigError, DataError
from maxctx.data import tasks
from maxctx import lengths
from maxctx.scoring import local, sweep


@pytest.fixture(scope="module", params=["sentencepiece", "tiktoken"])
def pieces(request, tmp_path_factory):
  if request.param == "sentencepiece":
    return tasks.Pieces(tokenizers.stdlib_tokenizer(512))
  # A byte-level Llama 3 style ranks file: no dummy-prefix space, so the joins must add one.
  path = tmp_path_factory.mktemp("tok") / "bytes.tiktoken"
  path.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
  return tasks.Pieces(tokenizers.load(str(path)))


@pytest.mark.parametrize("task", list(tasks.TASKS))
@pytest.mark.parametrize("length", [1024, 3000, 8192])
def test_examples_have_exact_length_needle_at_depth_and_findable_answer(pieces, task, length):
  tok = pieces.tokenizer
  for depth in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
    for index in range(2):
      e = tasks.generate(task, pieces, length, depth, index, seed=3)
      assert len(e.prompt) + len(e.answer) == length  # what the model reads: prompt + answer, exactly
      assert e.prompt.dtype == np.int32 and e.answer.dtype == np.int32
      assert abs(e.measured_depth - depth) <= 0.01, (task, length, depth, e.measured_depth)
      # The needle really is at needle_start: its tokens hold the answer's first part.
      needle = tok.decode(e.prompt[e.needle_start:e.needle_start + e.needle_len].tolist())
      assert e.parts[0] in needle, (needle, e.parts)
      text = tok.decode(e.prompt.tolist())
      assert all(part in text for part in e.parts), (e.parts, e.answer_text)
      assert all(part in e.answer_text for part in e.parts)
      assert tok.decode(e.answer.tolist()).strip() == e.answer_text


def test_answers_listed_in_order_of_appearance(pieces):
  tok = pieces.tokenizer
  for task in ("niah_multivalue", "variable_tracking"):
    for depth in (0.0, 0.5, 1.0):
      e = tasks.generate(task, pieces, 2048, depth, 0)
      text = tok.decode(e.prompt.tolist())
      # Each value (or variable name) where it is introduced: "is: v." or "VAR name =".
      marks = [f"is: {p}." if task == "niah_multivalue" else f"VAR {p} =" for p in e.parts]
      found = sorted(e.parts, key=lambda p: text.index(marks[e.parts.index(p)]))
      assert e.answer_text == ", ".join(found)


def test_same_seed_same_tokens_other_seed_other_tokens(pieces):
  for task in tasks.NAMES:
    a = tasks.generate(task, pieces, 3000, 0.5, 7, seed=1)
    b = tasks.generate(task, pieces, 3000, 0.5, 7, seed=1)
    c = tasks.generate(task, pieces, 3000, 0.5, 7, seed=2)
    d = tasks.generate(task, pieces, 3000, 0.5, 8, seed=1)
    assert np.array_equal(a.prompt, b.prompt) and np.array_equal(a.answer, b.answer)
    assert a.answer_text != c.answer_text and a.answer_text != d.answer_text


def _words(pieces, e):
  """The words of an example's context, in order (numbers and dots are not words)."""
  context = e.prompt[e.context_start:e.context_start + e.context_len].tolist()
  return re.findall(r"[a-z]+", pieces.tokenizer.decode(context))


# 1k and 4k are the sizes the command line is asked for; with one token per byte cwe needs more than either.
@pytest.mark.parametrize("task", sorted(tasks.NO_DEPTH))
def test_needleless_tasks_have_exact_length_and_the_answer_the_text_implies(pieces, task):
  byte_level = isinstance(pieces.tokenizer, tokenizers.Tiktoken)  # the fixture's ranks file: one token per byte
  lengths = [3000, 8192, 20000] + ([1024, 4096] if not byte_level or task == "fwe" else [])
  tok = pieces.tokenizer
  for length in lengths:
    for index in range(3):
      e = tasks.generate(task, pieces, length, 0.0, index, seed=5)
      assert len(e.prompt) + len(e.answer) == length
      assert e.context_start + e.context_len + len(e.answer) < length  # the question follows the context
      assert tok.decode(e.answer.tolist()).strip() == e.answer_text == ", ".join(e.parts)
      counts = collections.Counter(words := _words(pieces, e))
      if task == "cwe":
        # The ten parts are listed more often than any other word, and named in order of first appearance.
        assert len(e.parts) == 10 and min(counts[p] for p in e.parts) > max(
            c for w, c in counts.items() if w not in e.parts)
        assert list(e.parts) == sorted(e.parts, key=words.index)
        assert min(counts[p] for p in e.parts) == (30 if length >= 4096 else 6)
      else:
        # Ranks 2-4 (rank 1 is the dots) with strictly falling counts, the fourth word listed less often.
        top = counts.most_common(4)
        assert [w for w, _ in top[:3]] == list(e.parts) and top[0][1] > top[1][1] > top[2][1] > top[3][1]


@pytest.mark.parametrize("task", [t for t in tasks.NAMES if t not in {"passkey", "passkey_short", "niah_single",
                                                                   "niah_multikey"}])  # one-part answers
def test_answer_spans_spell_their_parts(pieces, task):
  tok = pieces.tokenizer
  for index in range(3):
    e = tasks.generate(task, pieces, 8192, 0.5, index)
    assert len(e.spans) == len(e.parts) > 1
    for part, (start, end) in zip(e.parts, e.spans):
      assert end > start and part in tok.decode(e.answer[start:end].tolist())
    # Spans do not overlap, so getting one part wrong never costs another.
    bounds = sorted(e.spans)
    assert all(a[1] <= b[0] for a, b in zip(bounds, bounds[1:]))


def test_multiquery_lists_values_in_the_order_the_question_names_keys(pieces):
  tok = pieces.tokenizer
  for depth in (0.0, 0.5, 1.0):
    e = tasks.generate("niah_multiquery", pieces, 2048, depth, 0)
    text = tok.decode(e.prompt.tolist())
    value_of = dict(re.findall(r"numbers for (\w+) is: (\d+)\.", text))
    asked = re.search(r"numbers for (\w+), (\w+), (\w+), and (\w+) mentioned", text).groups()
    assert len(value_of) == 4 and e.answer_text == ", ".join(value_of[k] for k in asked)


def test_user_errors_are_one_sentence_before_anything_runs(pieces, tmp_path):
  with pytest.raises(ConfigError, match=r"task niah_multikey needs at least \d+ tokens .* choose lengths of \d+"):
    tasks.generate("niah_multikey", pieces, 100, 0.5, 0)
  for task in ("cwe", "fwe"):
    with pytest.raises(ConfigError, match=rf"task {task} needs at least \d+ tokens .* choose lengths of \d+"):
      tasks.generate(task, pieces, 250, 0.0, 0)
  with pytest.raises(ConfigError, match="did you mean 'passkey'"):
    sweep.parse_tasks("passkye", "--tasks")
  with pytest.raises(ConfigError, match="--lengths has length '4q'"):
    lengths.parse_lengths("1k,4q", "--lengths")
  with pytest.raises(ConfigError, match=r"depth '1.5'.* in \[0, 1\]"):
    sweep.parse_depths("0,1.5", "--depths")
  assert lengths.parse_lengths("512, 1k,16K,1m", "x") == [512, 1024, 16384, 1 << 20]
  missing = tmp_path / "nope.jsonl"
  with pytest.raises(DataError, match="does not exist"):
    local.read(str(missing), pieces)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"context": "a", "question": "b", "answer": "c"}\n{"context": "a", "query": "b"}\n')
  with pytest.raises(DataError, match="bad.jsonl line 2 needs the fields context, question and answer"):
    local.read(str(bad), pieces)


def test_task_file_records_become_examples(pieces, tmp_path):
  path = tmp_path / "qa.jsonl"
  path.write_text('{"context": "Alice keeps a red kite.", "question": "What colour is the kite?", "answer": "red"}\n'
                  '\n{"context": "x", "question": "y", "answer": ["blue", "navy"], "extra": 1}\n')
  examples = local.read(str(path), pieces)
  assert [e.task for e in examples] == ["qa", "qa"]
  assert [e.answer_text for e in examples] == ["red", "blue"]
  e = examples[0]
  assert e.depth == -1.0 and e.length == len(e.prompt) + len(e.answer)
  assert "Alice keeps a red kite." in pieces.tokenizer.decode(e.prompt.tolist())
