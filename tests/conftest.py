"""Every test runs on the CPU with 8 fake devices, so each collective path is exercised without accelerators."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402  (after the flags above)

jax.config.update("jax_default_matmul_precision", "highest")
