"""Synthetic long-context tasks: a needle (or several) hidden in filler text, and the question that asks for it.

Every example is built in tokens, not characters, so its length is exact for any tokenizer: the model reads
`prompt + answer` and that is exactly `length` tokens (as in RULER, the length budget includes the answer), which also
keeps the sequence divisible by the context-parallel degree with no padding. The prompt is

    [BOS] header  context  question        answer
                  └ filler with the needles at their depths

Depth d of the asked needle means: its first token sits at d × (context tokens − needle tokens) inside the context, so
0 is the very start of the context and 1 puts the needle's last token at the context's end. Pieces are encoded one by
one and joined as if by spaces, so the decoded prompt holds each needle's text verbatim and a plain string search finds
every part of the answer (a task is never unanswerable, whatever the tokenizer does at the joins).

Examples are a pure function of (task, seed, length, depth, index) and the tokenizer: same inputs, same tokens.

  passkey            a 5-digit number in repeated filler (Mohtashami & Jaggi's passkey retrieval)
  passkey_short      "The pass key=K." with K five different digits, no header, and the question "The pass key=": at
                     128 tokens most of the context is filler, so the needle has ~100 places (the extension demo's task)
  niah_single        one "special magic number" for a key word
  niah_multikey      four key–value needles with different keys; the question asks for one
  niah_multivalue    four values for the same key; the answer is all of them, in order of appearance
  niah_multiquery    four key–value needles with different keys; the question asks for all four values, in the order
                     it names the keys
  variable_tracking  RULER's chained assignments: VAR A = 12345, VAR B = VAR A, ...; the answer names every variable
                     that holds the value, in order of appearance
  cwe, fwe           RULER's common- and frequent-word extraction, which have no needle (maxctx.data.ruler)

An answer of several parts is scored as RULER scores it, by the share of the parts found (`spans` says which answer
tokens spell each part).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Callable, Sequence

import numpy as np

from maxctx.data import ruler
from maxctx.errors import ConfigError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                  "I will quiz you about the important information there.")
NIAH_HEADER = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.")
VT_HEADER = "Memorize and track the chain(s) of variable assignment hidden in the following text."
# Key words for the needles: short, common, and distinct after any subword split.
WORDS = ("apple", "river", "candle", "forest", "window", "silver", "garden", "pencil", "rocket", "violin", "harbor",
         "meadow", "lantern", "copper", "falcon", "marble", "orchid", "pepper", "saddle", "thunder", "walnut",
         "anchor", "basket", "cactus", "dragon", "engine", "feather", "glacier", "hammer", "island", "jacket",
         "kettle", "ladder", "magnet", "needle", "oyster", "parrot", "quartz", "ribbon", "shadow", "tunnel",
         "umbrella", "velvet", "whistle", "yogurt", "zipper", "blanket", "compass", "dolphin", "emerald")


@dataclasses.dataclass(frozen=True)
class Example:
  """One scored item. `prompt` + `answer` is what the model reads; `parts` are the answer's strings, each present
  verbatim in the decoded prompt. Needle bookkeeping (token offsets into `prompt`) is for tests and reports."""
  task: str
  length: int
  depth: float
  index: int
  prompt: np.ndarray          # int32 [prompt tokens]
  answer: np.ndarray          # int32 [answer tokens]
  answer_text: str
  parts: tuple[str, ...]
  needle_start: int = -1      # first token of the asked needle in `prompt`; -1 for tasks read from files
  needle_len: int = 0
  context_start: int = 0
  context_len: int = 0
  spans: tuple[tuple[int, int], ...] = ()  # answer tokens [start, end) of each part; () for one part, the whole answer

  @property
  def measured_depth(self) -> float:
    room = self.context_len - self.needle_len
    return (self.needle_start - self.context_start) / room if room > 0 else 0.0


class Pieces:
  """Encodes text pieces so that their concatenated ids decode as the pieces joined by single spaces.

  SentencePiece adds a dummy-prefix space to every encode call, tiktoken adds none; joining must not depend on which.
  """

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    a, b = tokenizer.encode("a"), tokenizer.encode("b")
    self._space = " " if tokenizer.decode(a + b) == "ab" else ""
    self.bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    # Only letters and words the tokenizer gives back intact (a small SentencePiece model may map a rare capital to
    # <unk>), so that every answer stays findable in the prompt's text.
    intact = lambda text: tokenizer.decode(self(text)).strip() == text
    self.letters = "".join(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if intact(c))
    self.words = tuple(w for w in WORDS if intact(w))

  def __call__(self, text: str) -> list[int]:
    return self.tokenizer.encode(self._space + text)

  def filler(self, n: int, start: int = 0) -> list[int]:
    """`n` tokens of the noise text repeated, starting `start` tokens into the repetition."""
    unit = self(NOISE)
    reps = (start + n) // len(unit) + 1
    return (unit * reps)[start:start + n]


@dataclasses.dataclass(frozen=True)
class _Spec:
  header: str
  needles: list[str]            # needle texts; needles[0] is the one placed at the requested depth
  question: str
  answer: str
  parts: tuple[str, ...]
  answer_in_order: bool = False  # answer lists needles' values in order of appearance: built after placement
  order_values: tuple[str, ...] = ()


def _number(rng: np.random.Generator, digits: int) -> str:
  return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def _passkey(rng, pieces) -> _Spec:
  key = _number(rng, 5)
  return _Spec(PASSKEY_HEADER, [f"The pass key is {key}. Remember it. {key} is the pass key."],
               "What is the pass key? The pass key is", key, (key,))


def _passkey_short(rng, pieces) -> _Spec:
  # Five different digits: each answer token follows a token that occurs once in the needle, so it has one place to
  # be copied from (a small model learns that in far fewer steps than the order of repeated digits).
  digits = rng.permutation(10)
  digits = digits[:5] if digits[0] else digits[1:6]
  key = "".join(map(str, digits))
  return _Spec("", [f"The pass key={key}."], "The pass key=", key, (key,))


def _niah_single(rng, pieces) -> _Spec:
  word, value = pieces.words[rng.integers(len(pieces.words))], _number(rng, 7)
  return _Spec(NIAH_HEADER, [f"One of the special magic numbers for {word} is: {value}."],
               f"What is the special magic number for {word} mentioned in the provided text? "
               f"The special magic number for {word} mentioned in the provided text is", value, (value,))


def _niah_multikey(rng, pieces, keys: int = 4) -> _Spec:
  words = [pieces.words[i] for i in rng.choice(len(pieces.words), keys, replace=False)]
  values = [_number(rng, 7) for _ in words]
  needles = [f"One of the special magic numbers for {w} is: {v}." for w, v in zip(words, values)]
  return _Spec(NIAH_HEADER, needles,
               f"What is the special magic number for {words[0]} mentioned in the provided text? "
               f"The special magic number for {words[0]} mentioned in the provided text is", values[0], (values[0],))


def _niah_multivalue(rng, pieces, values: int = 4) -> _Spec:
  word = pieces.words[rng.integers(len(pieces.words))]
  vals = [_number(rng, 7) for _ in range(values)]
  return _Spec(NIAH_HEADER, [f"One of the special magic numbers for {word} is: {v}." for v in vals],
               f"What are all the special magic numbers for {word} mentioned in the provided text? "
               f"The special magic numbers for {word} mentioned in the provided text are", "", tuple(vals),
               answer_in_order=True, order_values=tuple(vals))


def _niah_multiquery(rng, pieces, keys: int = 4) -> _Spec:
  words = [pieces.words[i] for i in rng.choice(len(pieces.words), keys, replace=False)]
  values = [_number(rng, 7) for _ in words]
  # The needles go in at random places and the question names the keys in its own order, as RULER's does.
  query = ", ".join(words[:-1]) + ", and " + words[-1]
  return _Spec(NIAH_HEADER, [f"One of the special magic numbers for {w} is: {v}." for w, v in zip(words, values)],
               f"What are all the special magic numbers for {query} mentioned in the provided text? "
               f"The special magic numbers for {query} mentioned in the provided text are", ", ".join(values),
               tuple(values))


def _variable_tracking(rng, pieces, hops: int = 4) -> _Spec:
  letters = np.array(list(pieces.letters))
  names: list[str] = []
  while len(names) < hops + 1:
    name = "".join(rng.choice(letters, 5))
    if name not in names:
      names.append(name)
  value = _number(rng, 5)
  needles = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
  return _Spec(VT_HEADER, needles,
               f"Question: Find all variables that are assigned the value {value} in the text above. "
               "Answer: According to the chain(s) of variable assignment in the text above, "
               f"{hops + 1} variables are assigned the value {value}, they are:", "", tuple(names),
               answer_in_order=True, order_values=tuple(names))


TASKS: dict[str, Callable[[np.random.Generator, Pieces], _Spec]] = {
    "passkey": _passkey,
    "passkey_short": _passkey_short,
    "niah_single": _niah_single,
    "niah_multikey": _niah_multikey,
    "niah_multivalue": _niah_multivalue,
    "niah_multiquery": _niah_multiquery,
    "variable_tracking": _variable_tracking,
}
NO_DEPTH = frozenset(ruler.TASKS)  # tasks without a needle: made once per length and index, at depth 0
NAMES = (*TASKS, *ruler.TASKS)


def check_tasks(names: Sequence[str], where: str) -> None:
  for name in names:
    if name not in NAMES:
      close = difflib.get_close_matches(name, NAMES, n=1)
      hint = f"did you mean {close[0]!r}?" if close else f"choose from {', '.join(NAMES)}."
      raise ConfigError(f"{where} names task {name!r}, which does not exist; {hint}")


def _seed(task: str, seed: int, length: int, depth: float, index: int) -> list[int]:
  return [seed, sum(ord(c) * 31 ** i for i, c in enumerate(task)) % 2**31, length, int(round(depth * 10**6)), index]


def generate(task: str, pieces: Pieces, length: int, depth: float, index: int, seed: int = 0) -> Example:
  """Example `index` of `task` at `length` tokens (prompt + answer) with the asked needle at `depth` in [0, 1]."""
  check_tasks([task], "generate()")
  if not 0.0 <= depth <= 1.0:
    raise ConfigError(f"needle depth {depth} is outside [0, 1]; give depths as fractions of the context, e.g. 0,0.5,1.")
  rng = np.random.default_rng(_seed(task, seed, length, depth, index))
  if task in NO_DEPTH:
    p = ruler.TASKS[task](rng, pieces, length)
    return Example(task=task, length=length, depth=depth, index=index,
                   prompt=np.asarray(p.head + p.context + p.question, np.int32),
                   answer=np.asarray(p.answer, np.int32), answer_text=p.answer_text, parts=p.parts,
                   context_start=len(p.head), context_len=len(p.context), spans=_spans(pieces, p.answer, p.parts))
  spec = TASKS[task](rng, pieces)
  head = pieces.bos + (pieces(spec.header) if spec.header else [])
  question = pieces(spec.question)
  needles = [pieces(n) for n in spec.needles]
  # The answer's length must be known before the context is sized; for answers listed in order of appearance the
  # order is decided below, but every order has the same pieces, so size one and rebuild after placement.
  answer_text = spec.answer or ", ".join(spec.order_values)
  answer_len = len(pieces(answer_text))
  context_len = length - len(head) - len(question) - answer_len
  room = context_len - sum(len(n) for n in needles)
  if room < 0:
    need = length - room
    raise ConfigError(f"task {task} needs at least {need} tokens with this tokenizer but was asked for {length}; "
                      f"choose lengths of {need} or more.")

  # The asked needle first, at its exact depth; the others go into the filler before or after it, at random.
  start = int(round(depth * (context_len - len(needles[0]))))
  before_room, after_room = start, context_len - start - len(needles[0])
  before, after = [], []
  for i in rng.permutation(np.arange(1, len(needles))):
    n = len(needles[i])
    go_before = rng.random() < depth
    if go_before and n > before_room - sum(len(needles[j]) for j in before):
      go_before = False
    if not go_before and n > after_room - sum(len(needles[j]) for j in after):
      go_before = True
    (before if go_before else after).append(int(i))
  before_fill = before_room - sum(len(needles[j]) for j in before)
  after_fill = after_room - sum(len(needles[j]) for j in after)
  context = _interleave(rng, [needles[j] for j in before], pieces.filler(before_fill, 0))
  context += needles[0]
  context += _interleave(rng, [needles[j] for j in after], pieces.filler(after_fill, before_fill))
  assert len(context) == context_len, (len(context), context_len)

  if spec.answer_in_order:
    # Needle k carries order_values[k]; list them by where they ended up.
    where = {0: start}
    offset = 0
    for seg in (before, None, after):
      if seg is None:
        offset = start + len(needles[0])
        continue
      for j in seg:
        where[j] = _find(context, needles[j], offset)
    order = sorted(range(len(needles)), key=lambda k: where[k])
    answer_text = ", ".join(spec.order_values[k] for k in order)
  answer = pieces(answer_text)
  assert len(answer) == answer_len, "answer token count depends on the order of its parts"
  prompt = np.asarray(head + context + question, np.int32)
  return Example(task=task, length=length, depth=depth, index=index, prompt=prompt, answer=np.asarray(answer, np.int32),
                 answer_text=answer_text, parts=spec.parts, needle_start=len(head) + start, needle_len=len(needles[0]),
                 context_start=len(head), context_len=context_len, spans=_spans(pieces, answer, spec.parts))


def _spans(pieces: Pieces, answer: list[int], parts: Sequence[str]) -> tuple[tuple[int, int], ...]:
  """For each part, the answer tokens [start, end) whose text overlaps it (a token may span a part and a comma)."""
  if len(parts) < 2:
    return ()
  decode = pieces.tokenizer.decode
  text = decode(answer)
  ends = [len(decode(answer[:i + 1])) for i in range(len(answer))]
  starts = [0] + ends[:-1]
  out = []
  for part in parts:
    c = text.find(part)
    assert c >= 0, (part, text)
    hit = [i for i in range(len(answer)) if starts[i] < c + len(part) and ends[i] > c]
    out.append((hit[0], hit[-1] + 1))
  return tuple(out)


def _interleave(rng, needles: list[list[int]], filler: list[int]) -> list[int]:
  """Needles at random, distinct offsets of the filler, in the given order."""
  cuts = np.sort(rng.integers(0, len(filler) + 1, len(needles)))
  out, prev = [], 0
  for cut, needle in zip(cuts, needles):
    out += filler[prev:cut] + needle
    prev = cut
  return out + filler[prev:]


def _find(haystack: list[int], needle: list[int], start: int) -> int:
  n = len(needle)
  for i in range(start, len(haystack) - n + 1):
    if haystack[i:i + n] == needle:
      return i
  raise AssertionError("a placed needle is missing from its context")


def sweep(tasks: Sequence[str], lengths: Sequence[int], depths: Sequence[float], samples: int, pieces: Pieces,
          seed: int = 0) -> list[Example]:
  """Every (task, length, depth) cell with `samples` examples each, all checked for size before any is built; a task
  without a needle has one cell per length, at depth 0."""
  check_tasks(tasks, "--tasks")
  return [generate(t, pieces, n, d, i, seed) for t in tasks for n in lengths
          for d in ([0.0] if t in NO_DEPTH else depths) for i in range(samples)]
