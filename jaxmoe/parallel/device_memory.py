"""Refuse a train step that cannot fit in device memory before anything is compiled.

The estimate is a lower bound from the config and the state's shardings alone, so it never
refuses a step that fits: the exact parameters + optimizer state each device holds, their
gradients, the float32 logits of one micro-batch (of one train.loss_chunk) and one
residual-stream activation per layer (what even a fully rematerialised backward pass
keeps). Anything it misses only makes the real step bigger. Without it, an impossible step
costs a full compile before XLA (or the kernel) reports an out-of-memory error.
"""

import math
import os

import jax

from jaxmoe.errors import ConfigError
from jaxmoe.parallel.chips import GiB
from jaxmoe.parallel.sharding import data_parallel_size


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


def step_bytes_lower_bound(config, mesh, abstract_state, shardings) -> dict[str, float]:
    """Per-device bytes a train step needs at least, by part."""
    m, t = config.model, config.train
    rows = max(1.0, t.batch_size / t.grad_accum / data_parallel_size(mesh))
    tensor = dict(mesh.shape).get("tensor", 1)
    itemsize = 2 if m.dtype == "bfloat16" else 4
    layers = m.num_layers
    if m.arch == "encoder_decoder":
        layers += m.num_encoder_layers or m.num_layers
    return {
        "state": state_bytes_per_device(abstract_state, shardings),
        "gradients": state_bytes_per_device(abstract_state["params"], shardings["params"]),
        # train.loss_chunk: the loss holds one chunk's logits at a time (training/chunked_loss.py)
        "logits": rows * min(t.loss_chunk or t.seq_len, t.seq_len) * m.vocab_size * 4 / tensor,
        "activations": rows * t.seq_len * m.d_model * itemsize * layers,
    }


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


def check_step_fits(config, mesh, abstract_state, shardings) -> None:
    """A one-line ConfigError when the lower bound exceeds one device's memory."""
    t = config.train
    refuse_over_memory(
        step_bytes_lower_bound(config, mesh, abstract_state, shardings),
        f"train.batch_size={t.batch_size} x train.seq_len={t.seq_len} with this model",
        "lower train.batch_size or train.seq_len, raise train.grad_accum, or shard over "
        "more devices (mesh.fsdp)",
    )
