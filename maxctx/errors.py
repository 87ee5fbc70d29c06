"""Errors a user can cause. Each carries one sentence: what is wrong, where, and how to fix it.

The entry points catch these and print the sentence without a traceback; anything else is a bug in maxctx.
"""


import argparse
import reprlib
import sys
from typing import Any, Callable, NoReturn

# The most of a value an error shows: enough to recognise it, never a flood (a 10 MB string, a deep list).
EXCERPT_CHARS = 100
# The most of a sentence an entry point prints; what is longer is cut in the middle (the what and the fix survive).
SENTENCE_CHARS = 1000
_REPR = reprlib.Repr(maxlevel=3, maxtuple=6, maxlist=6, maxarray=6, maxdict=6, maxset=6, maxstring=EXCERPT_CHARS,
                     maxother=EXCERPT_CHARS)


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
  """repr(value) for an error, at most `limit` characters: built without expanding a huge or deeply nested value."""
  text = _REPR.repr(value)
  return text if len(text) <= limit else text[:limit - 1] + "…"


def sentence(e: BaseException) -> str:
  """An error's sentence as printed, cut to SENTENCE_CHARS."""
  text = " ".join(str(e).split("\n"))
  if len(text) <= SENTENCE_CHARS:
    return text
  head = SENTENCE_CHARS * 2 // 3
  return f"{text[:head]} … {text[len(text) - (SENTENCE_CHARS - head - 3):]}"


def exit_code(body: Callable[[], int | None]) -> int:
  """Runs an entry point's body: its return code (0 for None), or 2 after printing a user error's sentence without a
  traceback, or 130 when interrupted."""
  try:
    return body() or 0
  except MaxctxError as e:
    print(f"error: {sentence(e)}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130


class ArgumentParser(argparse.ArgumentParser):
  """The entry points' parser: a malformed command line is one sentence and exit code 2 (as a user error is), and a
  flag must be spelt out (no abbreviations, which a later flag could make ambiguous)."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("allow_abbrev", False)
    super().__init__(*args, **kwargs)

  def error(self, message: str) -> NoReturn:
    print(f"error: {self.prog}: {message}; see {self.prog} --help.", file=sys.stderr)
    raise SystemExit(2)


class MaxctxError(Exception):
  """Base class for errors caused by the user's config, data or files."""


class ConfigError(MaxctxError):
  """A config key, value or combination that cannot run."""


class DataError(MaxctxError):
  """Data, a tokenizer or a file that cannot be read or used."""


class CheckpointError(MaxctxError):
  """A checkpoint that does not match the run that is asked to use it."""
