"""A content fingerprint of a parameter tree, computed where the arrays live.

LoRA checkpoints (models/lora.py) hold adapters only; they record the fingerprint of the
base they were trained on, and any later use (resuming, eval, decode, merge, export) checks
the base it is given against it. Hashing the bytes of a 60 GB checkpoint on the host would
read it all once more; the base is on the devices anyway, so each tensor is reduced there to
two 32-bit sums of its float32 bits, each bit pattern weighted by an odd function of its
position (sums modulo 2^32 do not depend on the order or the sharding they are added in),
and sha256 runs over every tensor's path, shape and sums. Any changed value, a permutation
within a tensor or a tensor moved to another name changes the fingerprint.
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np


def _position_u32(shape) -> jax.Array:
    """uint32 flat position of each element (modulo 2^32), without a host array."""
    position = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        position = position + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(
            stride % 2**32
        )
        stride *= shape[axis]
    return position


@jax.jit
def _sums(tree):
    def one(x):
        bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)
        position = _position_u32(bits.shape)
        # Two odd multipliers (Knuth's and a second golden-ratio constant): odd, so every
        # position's weight is invertible modulo 2^32 and no element is ignored.
        weight = position * jnp.uint32(2654435761) + jnp.uint32(1)
        first = jnp.sum(bits * weight, dtype=jnp.uint32)
        second = jnp.sum(
            (bits ^ jnp.uint32(0x9E3779B9)) * (position * jnp.uint32(0x85EBCA6B) + jnp.uint32(3)),
            dtype=jnp.uint32,
        )
        return jnp.stack([first, second])

    return jax.tree.map(one, tree)


def tree_fingerprint(params: dict) -> str:
    """sha256 hex of a params tree's content (see the module doc): equal for equal values,
    whatever their dtype of storage (bfloat16 and float16 values are exact in float32),
    device placement or sharding."""
    sums = jax.tree.leaves(jax.device_get(_sums(params)))
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    digest = hashlib.sha256()
    for (path, leaf), pair in zip(leaves, sums, strict=True):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        digest.update(f"{name}\0{tuple(leaf.shape)}\0".encode())
        digest.update(np.asarray(pair, np.uint32).tobytes())
    return digest.hexdigest()
