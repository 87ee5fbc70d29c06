"""Every test runs on the CPU with 8 fake devices, so each collective path is exercised without accelerators.

One persistent compilation cache serves a whole test session: the xdist workers and the processes tests start
(resumed runs, multi-process runs, entry points) inherit its directory, so a program compiled once -- the demo's step
trained again by a resume test, a second process of the same run -- is loaded instead of compiled again. The
directory is made for the session and removed at its end, so no run reuses another's; a JAX_COMPILATION_CACHE_DIR
already set is used as it is. A loaded executable runs the same program as a compiled one; this only saves time.
"""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process of the session (xdist's controller) makes it
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="maxctx-tests-jax-cache-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import jax  # noqa: E402  (after the flags above)
import pytest  # noqa: E402

# The CPU tests compare numbers with float32 references, so matmuls run at full float32 precision.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def users_matmul_precision():
  """Compiles for a TPU in the precision `python -m maxctx.compile` uses, the default: under the suite's `highest` the
  TPU compiler emulates every float32 matmul in several bfloat16 passes, a program no user compiles (other memory
  figures), and compiles it twice as slowly (the tiny model's step at 4,096 tokens and 16 layers for v5p:2x2x1: 74 s
  against 39, alone on one core)."""
  with jax.default_matmul_precision("default"):
    yield


def pytest_collection_modifyitems(items):
  """The tests marked slow run first, in file order, then the rest: under `make test`'s two workers, a long test handed
  out last would keep one worker busy while the other has nothing left to do."""
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # a stable sort: file order otherwise
