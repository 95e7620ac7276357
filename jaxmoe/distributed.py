"""Multi-process start-up: `jax.distributed.initialize` exactly once, before any device use.

Explicit flags win; otherwise it is automatic on TPU pod slices and under SLURM with more
than one task, and skipped for a single process.
"""

import os

import jax

_initialized = False


def _cluster_detected() -> bool:
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h]) > 1


def initialize(coordinator_address=None, num_processes=None, process_id=None) -> None:
    global _initialized
    if _initialized:
        return
    if coordinator_address:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )
    elif _cluster_detected():
        jax.distributed.initialize()
    _initialized = True
