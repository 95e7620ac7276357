"""Multi-process start-up: `jax.distributed.initialize` once, before any device is used.

Explicit flags win; otherwise it is automatic on TPU pod slices and under SLURM with more
than one task (JAX reads the cluster from the environment), and skipped for one process.
"""

import os
import socket
import time

import jax

from jaxmoe.compat.private_apis import wait_at_barrier
from jaxmoe.errors import ConfigError
from jaxmoe.parallel.environment import env_int

DEFAULT_TIMEOUT_S = 300


def cluster_detected() -> bool:
    """True on a multi-host TPU slice or a multi-task SLURM job."""
    if "SLURM_JOB_ID" in os.environ and env_int("SLURM_NTASKS", 1) > 1:
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h.strip()]) > 1


def initialize(
    coordinator_address=None, num_processes=None, process_id=None, timeout_s: int | None = None
) -> None:
    """Join the run's processes; a coordinator that never answers fails within timeout_s."""
    if jax.distributed.is_initialized():
        return
    timeout_s = int(timeout_s or env_int("JAXMOE_INIT_TIMEOUT", DEFAULT_TIMEOUT_S))
    if coordinator_address:
        if num_processes is None or process_id is None:
            raise ConfigError(
                "--coordinator_address needs --num_processes and --process_id as well"
            )
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"--process_id={process_id} not in [0, {num_processes})")
        kwargs = dict(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )
        if process_id != 0:
            _wait_for_coordinator(coordinator_address, timeout_s)
    elif cluster_detected():
        kwargs = {}
    else:
        return
    try:
        jax.distributed.initialize(**kwargs, initialization_timeout=timeout_s)
    except Exception as error:  # the runtime's errors are long C++ status dumps
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RuntimeError(
            f"could not join the distributed run (coordinator "
            f"{coordinator_address or 'from the cluster environment'}, "
            f"{timeout_s}s timeout): {first[:300]}"
        ) from error


def _wait_for_coordinator(address: str, timeout_s: int) -> None:
    """Poll the coordinator's port: JAX's runtime aborts the process (SIGABRT) on a
    registration timeout, so an unreachable coordinator is reported here instead."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--coordinator_address={address!r}: expected HOST:PORT")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError as error:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"coordinator {address} unreachable after {timeout_s}s "
                    f"({error.strerror or error}); is process 0 running and the port open?"
                ) from None
            time.sleep(0.5)


def barrier(name: str, timeout_s: float) -> None:
    """Blocks until every process reaches the barrier `name` (unique per run); raises
    TimeoutError after `timeout_s`. A no-op in a single-process run."""
    if jax.process_count() == 1:
        return
    try:
        wait_at_barrier(name, int(timeout_s * 1000))  # False: no client, nothing to wait for
    except Exception as error:  # the runtime raises XlaRuntimeError with a long status dump
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TimeoutError(f"barrier {name!r} after {timeout_s:g}s: {first[:200]}") from None
