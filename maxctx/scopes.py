"""Names of the `jax.named_scope` regions that tools read back: the model opens them, and the compiled HLO's metadata
and the profiler's events carry them, so maxctx.compile and maxctx.bench can tell the attention strategy's own
communication from data parallelism and ZeRO-3 traffic, and how many times a loop whose bound the compiler cannot see
runs."""

ATTENTION = "attention"


def marker(scope: str) -> str:
  """How a scope appears inside an op name in HLO metadata and trace events: `jit(step)/.../attention/...`."""
  return f"/{scope}/"


TRIPS = "maxctx_trips_"


def trips(n: int) -> str:
  """The scope around a loop that runs n times though its bound is opaque to XLA (the ring's passes), so that
  maxctx.compile.hlo counts its collectives n times: the while's op name then ends in `/maxctx_trips_<n>/while`."""
  return f"{TRIPS}{n}"
