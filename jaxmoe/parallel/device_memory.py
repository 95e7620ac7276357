"""One device's memory: the bytes a sharded tree holds on its most loaded device, what a
device may use, and the one-line refusal of work that cannot fit, made before anything is
compiled (training/step_memory.py for a train step; decoding's and the compile check's
reports count state the same way).
"""

import math
import os

import jax

from jaxmoe.errors import ConfigError
from jaxmoe.parallel.chips import GiB


def state_bytes_per_device(abstract_tree, shardings=None) -> int:
    """Bytes of `abstract_tree` held by the most loaded device: the one per-device count of
    training's memory check, decoding's and the compile check's reports. `shardings`
    defaults to the leaves' own (sharded ShapeDtypeStructs); no layout padding."""
    leaves = jax.tree.leaves(abstract_tree)
    placed = [leaf.sharding for leaf in leaves] if shardings is None else jax.tree.leaves(shardings)
    return sum(
        math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf, sharding in zip(leaves, placed, strict=True)
    )


def device_memory_bytes(device=None) -> tuple[float, str]:
    """(bytes one device may use, where that number comes from)."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats() or {}
    except (RuntimeError, NotImplementedError):
        stats = {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), f"{device.device_kind} memory"
    # CPU devices (also the simulated ones) share the host's RAM.
    host = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            host = min(host, float(limit))
    except OSError:
        pass
    count = jax.local_device_count()
    return host / count, f"host RAM / {count} local device(s)"


def refuse_over_memory(parts: dict, what: str, advice: str, error=ConfigError, device=None):
    """Raise `error` in one line when the bytes in `parts` exceed one device's memory."""
    need = sum(parts.values())
    have, source = device_memory_bytes(device)
    if need > have:
        detail = ", ".join(f"{k} {v / GiB:.2f}" for k, v in parts.items())
        raise error(
            f"{what} needs at least {need / GiB:.2f} GiB per device ({detail}), more than "
            f"the {have / GiB:.2f} GiB of {source}; {advice}"
        )
