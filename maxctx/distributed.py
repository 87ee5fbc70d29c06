"""Multi-host start-up: one JAX process per host, joined by `jax.distributed.initialize` before any device is touched.

    distributed.add_flags(parser)                                  # an entry point's argparse parser
    distributed.initialize_processes(distributed.options(args))    # before anything touches a device

- On TPU VMs and GKE TPU node pools JAX finds the coordinator, process count and id itself (GKE sets
  TPU_WORKER_HOSTNAMES / TPU_WORKER_ID, a TPU VM's metadata server names its workers), so nothing needs passing.
- Elsewhere (GPU clusters, CPUs, tests) the coordinator is explicit: `--coordinator=HOST:PORT --num-processes=N
  --process-id=I`, or the environment variables MAXCTX_COORDINATOR, MAXCTX_NUM_PROCESSES, MAXCTX_PROCESS_ID.
- One host, no flags: nothing to join.

A process that dies must not leave the others waiting on a collective forever: the coordination service declares a
process dead after `heartbeat_timeout_s` without a heartbeat and the survivors exit with an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import logging
import os

import jax

from maxctx.errors import ArgumentParser, ConfigError

log = logging.getLogger("maxctx")

# Each flag's environment variable, read where the flag is not given.
FLAGS = {"--coordinator": "MAXCTX_COORDINATOR", "--num-processes": "MAXCTX_NUM_PROCESSES",
         "--process-id": "MAXCTX_PROCESS_ID"}
HEARTBEAT_TIMEOUT_S = 30
# GKE's TPU webhook and multislice (Megascale) set these on every TPU host of a job.
TPU_CLUSTER_ENV = ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "MEGASCALE_COORDINATOR_ADDRESS")


@dataclasses.dataclass(frozen=True)
class Options:
  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None


def add_flags(parser: argparse.ArgumentParser) -> None:
  """The multi-host flags, for every entry point that runs on devices."""
  group = parser.add_argument_group("multi-host (not needed on TPU VMs and GKE, where JAX finds the job itself)")
  group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (or MAXCTX_COORDINATOR)")
  group.add_argument("--num-processes", metavar="N", help="processes in the job (or MAXCTX_NUM_PROCESSES)")
  group.add_argument("--process-id", metavar="I", help="this process, 0 to N-1 (or MAXCTX_PROCESS_ID)")


def options(args: argparse.Namespace) -> Options:
  """The coordinator options from parsed flags (`add_flags`); a flag wins over its MAXCTX_* environment variable."""
  values = {flag: getattr(args, flag[2:].replace("-", "_"), None) or os.environ.get(env) or None
            for flag, env in FLAGS.items()}
  ints = {}
  for flag in ("--num-processes", "--process-id"):
    if values[flag] is not None:
      try:
        ints[flag] = int(values[flag])
      except ValueError:
        raise ConfigError(f"{flag} (or {FLAGS[flag]}) must be an integer, got {values[flag]!r}.") from None
  result = Options(values["--coordinator"], ints.get("--num-processes"), ints.get("--process-id"))
  _check(result)
  return result


def parse_args(argv: list[str]) -> tuple[Options, list[str]]:
  """(the coordinator options, the other arguments) of an argument list."""
  parser = ArgumentParser(add_help=False)
  add_flags(parser)
  args, rest = parser.parse_known_args(argv)
  return options(args), rest


def _check(o: Options) -> None:
  given = [o.coordinator is not None, o.num_processes is not None, o.process_id is not None]
  if any(given) and not all(given):
    raise ConfigError("--coordinator, --num-processes and --process-id go together (or MAXCTX_COORDINATOR, "
                      "MAXCTX_NUM_PROCESSES, MAXCTX_PROCESS_ID); give all three, or none on TPU VMs and GKE.")
  if o.coordinator is None:
    return
  host, _, port = o.coordinator.rpartition(":")
  if not host or not port.isdigit():
    raise ConfigError(f"--coordinator {o.coordinator!r} is not HOST:PORT; use e.g. --coordinator=10.0.0.2:1234 "
                      "(process 0's address, reachable from every process).")
  if o.num_processes < 1 or not 0 <= o.process_id < o.num_processes:
    raise ConfigError(f"--process-id {o.process_id} is not in [0, --num-processes {o.num_processes}); number the "
                      "processes 0 to N-1.")


def on_tpu_cluster() -> bool:
  """Whether this host is a TPU VM or a GKE TPU node, where JAX can discover the other hosts itself."""
  return any(os.environ.get(k) for k in TPU_CLUSTER_ENV) or bool(glob.glob("/dev/accel*") or
                                                                  glob.glob("/dev/vfio/[0-9]*"))


def initialize_processes(options: Options, heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> str:
  """Joins this process to the job; returns how ("explicit coordinator", "TPU cluster", "single process")."""
  if options.coordinator is not None:
    # CPU collectives between processes need a transport; gloo (TCP) ships with jaxlib. Other backends ignore it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(options.coordinator, options.num_processes, options.process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_s)
    how = "explicit coordinator"
  elif on_tpu_cluster():
    try:
      jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s)
    except (ValueError, RuntimeError) as e:
      # A single TPU VM (or a container on one) without the metadata server: one process is the whole job.
      if os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        raise
      log.info("no TPU cluster to join (%s); running as a single process", str(e).splitlines()[0])
      return "single process"
    how = "TPU cluster"
  else:
    return "single process"
  log.info("process %d of %d joined (%s); %d local of %d devices", jax.process_index(), jax.process_count(), how,
           jax.local_device_count(), jax.device_count())
  return how


def initialize(argv: list[str], heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> list[str]:
  """Parses the coordinator flags out of `argv`, joins the job, and returns the remaining arguments."""
  options, rest = parse_args(argv)
  initialize_processes(options, heartbeat_timeout_s)
  return rest
