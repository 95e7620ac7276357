"""Evaluation split across the processes of a multi-process run.

Each process evaluates its own share of the requests on a mesh of its own (local) devices,
so no compiled program spans processes and the processes never wait on each other while
they compute; what they found is gathered at the end through jax's multihost utilities
(`process_allgather`: a collective over every device, which is all that crosses hosts).
A model that does not fit on one host's devices needs the global mesh instead (not done).
"""

import pickle

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
