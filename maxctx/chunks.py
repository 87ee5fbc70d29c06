"""Even splits: the chunk sizes that the loss, the MLP and the attention kernels step through a device's tokens in."""


def divisor_at_most(request: int, tokens: int) -> int:
  """The largest divisor of `tokens` not above `request` (at least 1): a chunk that splits `tokens` evenly."""
  chunk = min(max(1, request), tokens)
  while tokens % chunk:
    chunk -= 1
  return chunk
