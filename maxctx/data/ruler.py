"""RULER's counting tasks: common-words (cwe) and frequent-words (fwe) extraction, built in tokens at an exact length.

There is no needle and no depth: the whole context is the haystack and the answer is a property of all of it.

  cwe  a numbered list `1. word 2. word ...` in which 10 words appear often and the rest rarely (6 times against
       once below 4,096 tokens, 30 against 3 from 4,096 up, as RULER); the answer is the 10 frequent words
  fwe  "coded text": random six-letter words with Zipf counts floor(N / k²) for rank k, rank 1 being the noise `...`
       the question says to ignore; the answer is ranks 2, 3 and 4, most frequent first

As RULER, the list grows until the next word would not fit. The few tokens left over are then filled where they change
no answer: cwe adds words listed once, then ends with the first tokens of one more entry (cut as the needle tasks' filler
is cut); fwe adds more of the noise `...`, one of them possibly cut. RULER's
metric (recall of the expected words) is order-free, but teacher forcing reads one answer, so it lists the words in an
order the text fixes: cwe by first appearance in the list, fwe by frequency. RULER's prompt begins with one solved
example; here the answer's format is read, not generated, and the example would not fit 1k tokens of a small
tokenizer, so there is none. cwe's words are made of syllables (`kotamu`), since RULER's word lists are downloads.

`pieces` is a maxctx.data.tasks.Pieces (which imports this module, so it is not named here).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from maxctx.errors import ConfigError

CWE_HEADER = ("Below is a numbered list of words. In these words, some appear more often than others. "
              "Memorize the ones that appear most often.")
CWE_QUESTION = ("Question: What are the 10 most common words in the above list? "
                "Answer: The top 10 words that appear most often in the list are:")
FWE_HEADER = ("Read the following coded text and track the frequency of each coded word. "
              "Find the three most frequently appeared coded words.")
FWE_QUESTION = ("Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text? Answer: According to the coded text above, the "
                "three most frequently appeared words are:")
COMMON = 10            # cwe: frequent words
FWE_NOISE = "..."
FWE_ANSWERS = 3        # fwe: ranks 2..4
SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))


@dataclasses.dataclass(frozen=True)
class Prompt:
  """A generated prompt in pieces: `head + context + question` then `answer`, `length` tokens in all."""
  head: list[int]
  context: list[int]
  question: list[int]
  answer: list[int]
  answer_text: str
  parts: tuple[str, ...]


def _too_short(task: str, length: int, short_by: int) -> ConfigError:
  need = length + short_by
  return ConfigError(f"task {task} needs at least {need} tokens with this tokenizer but was asked for {length}; "
                     f"choose lengths of {need} or more.")


def _distinct(rng: np.random.Generator, make: Callable[[np.random.Generator], str]):
  """Words from `make`, never one seen before."""
  seen = set()
  while True:
    word = make(rng)
    if word not in seen:
      seen.add(word)
      yield word


def common_words(rng: np.random.Generator, pieces, length: int) -> Prompt:
  often, rarely = (30, 3) if length >= 4096 else (6, 1)
  # Three syllables make 343,000 words; a list that could need half of them (entries take 2 tokens or more) gets four.
  syllables = 3 if length // (2 * rarely) < len(SYLLABLES) ** 3 // 2 else 4
  words = _distinct(rng, lambda r: "".join(SYLLABLES[i] for i in r.integers(len(SYLLABLES), size=syllables)))
  common = [next(words) for _ in range(COMMON)]
  head = pieces.bos + pieces(CWE_HEADER)
  question = pieces(CWE_QUESTION)
  answer_text = ", ".join(common)
  answer = pieces(answer_text)
  budget = length - len(head) - len(question) - len(answer)

  numbers: list[list[int]] = []  # numbers[i]: the tokens of "i+1.", entry i's number
  word_ids = [pieces(w) for w in common]
  def add(ids: list[int], times: int) -> int:
    """Lists a word `times` more times; the tokens that costs."""
    new = [pieces(f"{len(numbers) + 1 + i}.") for i in range(times)]
    numbers.extend(new)
    return sum(len(x) for x in new) + times * len(ids)
  used = sum(add(ids, often) for ids in word_ids)
  rare: list[int] = []  # indices into word_ids of the words listed `rarely` times
  while True:
    ids = pieces(next(words))
    cost = add(ids, rarely)
    if used + cost > budget and len(rare) >= COMMON:  # as many rare words as common ones at least
      del numbers[-rarely:]
      break
    used += cost
    rare.append(len(word_ids))
    word_ids.append(ids)
  if used > budget:
    raise _too_short("cwe", length, used - budget)
  # Less than `rarely` entries are left: single rare words while whole entries fit, then part of one more entry.
  once: list[int] = []
  while used + (cost := add(ids, 1)) <= budget:
    used += cost
    once.append(len(word_ids))
    word_ids.append(ids)
    ids = pieces(next(words))
  tail = (numbers.pop() + ids)[:budget - used]

  labels = np.concatenate([np.repeat(np.arange(COMMON), often), np.repeat(rare, rarely), once]).astype(np.int64)
  labels = labels[rng.permutation(len(labels))]
  # Every common word is listed equally often, so naming them in the order in which they first appear changes no
  # count, and the answer's order becomes the text's.
  first = list(dict.fromkeys(int(x) for x in labels if x < COMMON))
  rename = np.arange(len(word_ids))
  rename[first] = np.arange(COMMON)
  context: list[int] = []
  for number, label in zip(numbers, rename[labels]):
    context += number + word_ids[label]
  context += tail
  assert len(context) == budget, (len(context), budget)
  return Prompt(head, context, question, answer, answer_text, tuple(common))


def freq_words(rng: np.random.Generator, pieces, length: int) -> Prompt:
  head = pieces.bos + pieces(FWE_HEADER)
  question = pieces(FWE_QUESTION)
  # RULER's vocabulary has length / 50 words; ranks above √(tokens) would be listed floor(N / k²) = 0 times anyway.
  size = max(FWE_ANSWERS + 2, min(length // 50, int(np.sqrt(length)) + 1))
  words = _distinct(rng, lambda r: "".join(r.choice(LETTERS, 6)))
  vocab = [FWE_NOISE] + [next(words) for _ in range(size - 1)]
  answer_text = ", ".join(vocab[1:1 + FWE_ANSWERS])
  answer = pieces(answer_text)
  budget = length - len(head) - len(question) - len(answer)
  word_ids = [pieces(w) for w in vocab]
  cost = np.array([len(w) for w in word_ids])
  rank_sq = np.arange(1, size + 1) ** 2
  counts = lambda n: n // rank_sq
  tokens = lambda n: int(counts(n) @ cost)
  # The largest N whose text fits: tokens(N) grows with N, so bisect.
  lo, hi = 0, budget + 1
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if tokens(mid) <= budget else (lo, mid)
  n = lo
  # Ranks 2..5 must be listed strictly less often one after the other, or the answer is not one set of three.
  ranked = lambda n: all(a > b for a, b in zip(counts(n)[1:FWE_ANSWERS + 2], counts(n)[2:FWE_ANSWERS + 2]))
  if not ranked(n):
    least = next(m for m in range(n, 10 * size ** 2) if ranked(m))
    raise _too_short("fwe", length, tokens(least) - budget)
  count = counts(n)
  extra, cut = divmod(budget - tokens(n), len(word_ids[0]))
  count[0] += extra
  labels = np.repeat(np.arange(size), count)
  labels = np.append(labels, -1)[rng.permutation(len(labels) + 1)]  # -1: the cut noise word, somewhere in the text
  pieces_of = word_ids + [word_ids[0][:cut]]
  context = [t for label in labels for t in pieces_of[label]]
  assert len(context) == budget, (len(context), budget)
  return Prompt(head, context, question, answer, answer_text, tuple(vocab[1:1 + FWE_ANSWERS]))


TASKS: dict[str, Callable[[np.random.Generator, object, int], Prompt]] = {
    "cwe": common_words,
    "fwe": freq_words,
}
