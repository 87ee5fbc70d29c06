"""Errors a user can cause. Each carries one sentence: what is wrong, where, and how to fix it.

The entry points catch these and print the sentence without a traceback; anything else is a bug in maxctx.
"""


import argparse
import sys
from typing import Callable, NoReturn


def exit_code(body: Callable[[], int | None]) -> int:
  """Runs an entry point's body: its return code (0 for None), or 2 after printing a user error's sentence without a
  traceback, or 130 when interrupted."""
  try:
    return body() or 0
  except MaxctxError as e:
    print(f"error: {e}", file=sys.stderr)
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
