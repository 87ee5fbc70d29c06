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

Joining is bounded too: a coordinator that is never reachable, or peers that never arrive, end the process after
`--init-timeout` seconds (MAXCTX_INIT_TIMEOUT, default INIT_TIMEOUT_S: pods whose hosts start minutes apart still
join) with one sentence and exit code 2. JAX's own timeout would abort the process from C++ (LOG(FATAL), a stack
trace, exit 134) and cannot be caught, so a watchdog thread gives up first, prints the sentence and leaves with
os._exit: the main thread is blocked inside the coordination client and there is nothing to unwind or save.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import logging
import os
import socket
import sys
import threading
import time

import jax

from maxctx.errors import ArgumentParser, ConfigError, excerpt

log = logging.getLogger("maxctx")

# Each flag's environment variable, read where the flag is not given.
FLAGS = {"--coordinator": "MAXCTX_COORDINATOR", "--num-processes": "MAXCTX_NUM_PROCESSES",
         "--process-id": "MAXCTX_PROCESS_ID", "--init-timeout": "MAXCTX_INIT_TIMEOUT"}
HEARTBEAT_TIMEOUT_S = 30
INIT_TIMEOUT_S = 300
# JAX's own deadline comes this much after the watchdog's, so the watchdog always speaks first.
_JAX_GRACE_S = 60
# GKE's TPU webhook and multislice (Megascale) set these on every TPU host of a job.
TPU_CLUSTER_ENV = ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "MEGASCALE_COORDINATOR_ADDRESS")


@dataclasses.dataclass(frozen=True)
class Options:
  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  init_timeout_s: int = INIT_TIMEOUT_S


def add_flags(parser: argparse.ArgumentParser) -> None:
  """The multi-host flags, for every entry point that runs on devices."""
  group = parser.add_argument_group("multi-host (not needed on TPU VMs and GKE, where JAX finds the job itself)")
  group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (or MAXCTX_COORDINATOR)")
  group.add_argument("--num-processes", metavar="N", help="processes in the job (or MAXCTX_NUM_PROCESSES)")
  group.add_argument("--process-id", metavar="I", help="this process, 0 to N-1 (or MAXCTX_PROCESS_ID)")
  group.add_argument("--init-timeout", metavar="SECONDS",
                     help=f"how long to wait for the coordinator and every process to join (or MAXCTX_INIT_TIMEOUT; "
                          f"default {INIT_TIMEOUT_S})")


def options(args: argparse.Namespace) -> Options:
  """The coordinator options from parsed flags (`add_flags`); a flag wins over its MAXCTX_* environment variable."""
  values = {flag: getattr(args, flag[2:].replace("-", "_"), None) or os.environ.get(env) or None
            for flag, env in FLAGS.items()}
  ints = {}
  for flag in ("--num-processes", "--process-id", "--init-timeout"):
    if values[flag] is not None:
      try:
        ints[flag] = int(values[flag])
      except ValueError:
        raise ConfigError(f"{flag} (or {FLAGS[flag]}) must be an integer, got {excerpt(values[flag])}.") from None
  timeout = ints.get("--init-timeout", INIT_TIMEOUT_S)
  if timeout < 1:
    raise ConfigError(f"--init-timeout (or MAXCTX_INIT_TIMEOUT) is {timeout}; give the seconds to wait for the other "
                      f"processes to join, at least 1 (default {INIT_TIMEOUT_S}).")
  result = Options(values["--coordinator"], ints.get("--num-processes"), ints.get("--process-id"), timeout)
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
    raise ConfigError(f"--coordinator {excerpt(o.coordinator)} is not HOST:PORT; use e.g. --coordinator=10.0.0.2:1234 "
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
    with _Watchdog(options):
      jax.distributed.initialize(options.coordinator, options.num_processes, options.process_id,
                                 initialization_timeout=options.init_timeout_s + _JAX_GRACE_S,
                                 heartbeat_timeout_seconds=heartbeat_timeout_s)
    how = "explicit coordinator"
  elif on_tpu_cluster():
    try:
      with _Watchdog(options):
        jax.distributed.initialize(initialization_timeout=options.init_timeout_s + _JAX_GRACE_S,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s)
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


class _Watchdog:
  """Ends the process with one sentence if `jax.distributed.initialize` has not returned after the options' timeout.

  Meanwhile a process other than 0 checks every few seconds whether the coordinator accepts connections, so that the
  sentence can tell a coordinator never reached from one reached whose other processes never came."""

  def __init__(self, options: Options):
    self.options = options
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="maxctx-join-watchdog", daemon=True)

  def __enter__(self) -> _Watchdog:
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._done.set()

  def _watch(self) -> None:
    o = self.options
    deadline = time.monotonic() + o.init_timeout_s
    probe = o.coordinator is not None and o.process_id != 0
    why = None
    while (left := deadline - time.monotonic()) > 0:
      if probe:
        why = _unreachable(o.coordinator)
        probe = why is not None   # once reached, the coordinator was there
      if self._done.wait(min(left, 5.0)):
        return
    print(f"error: {join_timeout_message(o, why)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)


def _unreachable(address: str) -> str | None:
  """Why nothing answers at HOST:PORT (cannot resolve, refused, ...), or None when something accepts connections."""
  host, _, port = address.rpartition(":")
  try:
    socket.create_connection((host.strip("[]"), int(port)), timeout=3).close()
  except socket.gaierror:
    return f"the host {host} cannot be resolved"
  except OSError as e:
    return f"nothing accepts connections there ({e.strerror or 'timed out'})"
  return None


def join_timeout_message(o: Options, unreachable: str | None = None) -> str:
  """The sentence of a job that did not come together within `o.init_timeout_s`; `unreachable` says why the
  coordinator never answered, if it never did."""
  raise_it = f"or raise --init-timeout (MAXCTX_INIT_TIMEOUT, now {o.init_timeout_s} s) if hosts start further apart"
  if o.coordinator is None:
    return (f"this host did not join its TPU job within {o.init_timeout_s} s; check that every host of the job "
            f"(TPU_WORKER_HOSTNAMES) is running maxctx and can reach the others, {raise_it}.")
  together = (f"check that all {o.num_processes} processes run with --coordinator={o.coordinator} "
              f"--num-processes={o.num_processes} and distinct --process-id values 0 to {o.num_processes - 1}")
  if o.process_id == 0:
    return (f"process 0 (the coordinator, at {o.coordinator}) waited {o.init_timeout_s} s and not all "
            f"{o.num_processes} processes joined; {together}, and that they can reach {o.coordinator}, {raise_it}.")
  if unreachable is not None:
    return (f"process {o.process_id} of {o.num_processes} could not reach the coordinator at {o.coordinator} within "
            f"{o.init_timeout_s} s: {unreachable}; check that process 0 is running and that {o.coordinator} is its "
            f"address and reachable from this host (firewall, port), {raise_it}.")
  return (f"process {o.process_id} of {o.num_processes} reached the coordinator at {o.coordinator} but not all "
          f"{o.num_processes} processes joined within {o.init_timeout_s} s; {together}, {raise_it}.")


def initialize(argv: list[str], heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> list[str]:
  """Parses the coordinator flags out of `argv`, joins the job, and returns the remaining arguments."""
  options, rest = parse_args(argv)
  initialize_processes(options, heartbeat_timeout_s)
  return rest
