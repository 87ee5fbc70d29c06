"""Names of the `jax.named_scope` regions that tools read back: the model opens them, and the compiled HLO's metadata
and the profiler's events carry them, so maxctx.compile and maxctx.bench can tell the attention strategy's own
communication from data parallelism and ZeRO-3 traffic."""

ATTENTION = "attention"


def marker(scope: str) -> str:
  """How a scope appears inside an op name in HLO metadata and trace events: `jit(step)/.../attention/...`."""
  return f"/{scope}/"
