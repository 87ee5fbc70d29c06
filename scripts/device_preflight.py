"""The hardware checks' first stage: the packages they need are installed and JAX sees the device they check.

    python scripts/device_preflight.py tpu|gpu "<how to install what is missing>"

Exit 0 after printing the versions and the devices; otherwise one line naming what is missing. Under the suite's CPU
rehearsal (TPU_CHECK_CPU / GPU_CHECK_CPU set) any backend will do.
"""

import importlib.metadata as md
import os
import sys

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorboardX", "array-record")


def main(platform: str, install_hint: str) -> None:
  name = f"{platform}_check"
  missing = []
  for package in PACKAGES:
    try:
      print(f"{package} {md.version(package)}", end="; ")
    except md.PackageNotFoundError:
      missing.append(package)
  print()
  if missing:
    sys.exit(f"{name}: {', '.join(missing)} not installed; {install_hint}.")
  import jax
  if jax.default_backend() != platform and not os.environ.get(f"{platform.upper()}_CHECK_CPU"):
    sys.exit(f"{name}: JAX sees no {platform.upper()} here (backend {jax.default_backend()}); run it on the "
             f"{platform.upper()} machine.")
  print(f"{jax.devices()[0].device_kind} × {jax.device_count()}, jax {jax.__version__}")


if __name__ == "__main__":
  main(*sys.argv[1:3])
