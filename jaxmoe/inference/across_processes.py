"""Evaluation split across the processes of a multi-process run.

Each process evaluates its own share of the requests on a mesh of its own (local) devices,
so no compiled program spans processes and the processes never wait on each other while
they compute; what they found is gathered at the end through jax's multihost utilities
(`process_allgather`: a collective over every device, which is all that crosses hosts).
A model that does not fit on one host's devices needs the global mesh instead (not done).
"""

import json
import os
import pickle
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils


def multi_process() -> bool:
    return jax.process_count() > 1


def process_index() -> int:
    return jax.process_index()


def process_mesh(mesh_cfg):
    """This process's own mesh: `mesh_cfg` over its local devices in a multi-process run
    (each process evaluates separately), over all devices otherwise."""
    from jaxmoe.parallel.mesh import make_mesh

    return make_mesh(mesh_cfg, jax.local_devices() if multi_process() else None)


def allgather_array(value) -> np.ndarray:
    """[process_count, *shape]: every process's `value` (same shape on all)."""
    if not multi_process():
        return np.asarray(value)[None]
    return np.asarray(multihost_utils.process_allgather(np.asarray(value)))


def allgather_objects(obj) -> list:
    """Every process's picklable `obj`, in process order (pickles padded to one length)."""
    if not multi_process():
        return [obj]
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = allgather_array(np.int64(data.size)).reshape(-1)
    padded = np.zeros((int(sizes.max()),), np.uint8)
    padded[: data.size] = data
    gathered = allgather_array(padded)
    return [pickle.loads(row[:size].tobytes()) for row, size in zip(gathered, sizes, strict=True)]


def barrier(name: str) -> None:
    if multi_process():
        multihost_utils.sync_global_devices(name)


def shard(items: list, index: int | None = None, count: int | None = None) -> list:
    """This process's strided share of `items` (every count-th from its index)."""
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    return items[index::count]


# Each process prints one `TIMING_TAG {json}` line per phase of an evaluation (joining the
# run, loading the model, each request kind, each gather): epoch timestamps and seconds, so a
# multi-process run's time can be split into start-up, compile, the request loop and the
# gather (benchmarks/lm_eval_processes.py reads them).
TIMING_TAG = "jaxmoe-lm-eval-timing"


def log_timing(phase: str, start: float, seconds: float, **fields) -> None:
    """One timing line: `phase` began at epoch `start` and took `seconds` on this process."""
    record = {"process": jax.process_index(), "processes": jax.process_count(), "phase": phase}
    record |= {"start": start, "seconds": seconds, **fields}
    print(f"{TIMING_TAG} {json.dumps(record)}", flush=True)


def process_started() -> float | None:
    """When this process started (epoch seconds, to 10 ms: Linux's /proc counts it in clock
    ticks since boot), None where unknown."""
    import time

    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        since_boot = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - since_boot + ticks / os.sysconf("SC_CLK_TCK")
