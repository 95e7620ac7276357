"""Every converter refuses NaN and infinite weights, naming the tensor: such a model only
ever produces NaN losses and garbage tokens, far from the file that caused them."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.checkpoints.manager import CheckpointError


def check_finite(value, what: str):
    """`value` (a numpy or jax array, counted where it lives) unchanged; CheckpointError
    `{what} holds N NaN or infinite value(s)` if it has any. Integer arrays pass."""
    dtype = np.dtype(value.dtype)
    if dtype.kind not in "fc" and not dtype.name.startswith(("bfloat", "float")):
        return value
    xp = jnp if isinstance(value, jax.Array) else np
    finite = xp.isfinite(value)
    if not bool(finite.all()):
        bad = int(finite.size - finite.sum())
        raise CheckpointError(f"{what} holds {bad} NaN or infinite value(s)")
    return value
