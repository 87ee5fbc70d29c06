"""Errors a user can cause. Each carries one sentence: what is wrong, where, and how to fix it.

The entry points catch these and print the sentence without a traceback; anything else is a bug in maxctx.
"""


class MaxctxError(Exception):
  """Base class for errors caused by the user's config, data or files."""


class ConfigError(MaxctxError):
  """A config key, value or combination that cannot run."""


class DataError(MaxctxError):
  """Data, a tokenizer or a file that cannot be read or used."""


class CheckpointError(MaxctxError):
  """A checkpoint that does not match the run that is asked to use it."""
