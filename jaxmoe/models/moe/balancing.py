"""Auxiliary-loss-free balancing (DeepSeek-V3): the selection biases move after every
optimizer step, never by the optimizer.

bias_e += rate * sign(mean_e' load_e' - load_e), with load_e the token-slots routed to
expert e in the step's whole (global) batch: an overloaded expert is chosen less next step.
The biases are parameters at `<moe layer>/selection_bias` (so checkpoints carry them);
`keep_selection_biases` undoes whatever the optimizer did to them (weight decay).
"""

import jax
import jax.numpy as jnp

from jaxmoe.models.mtp import mtp_key
from jaxmoe.models.stack import HEAD, PERIOD, TAIL

BIAS_NAME = "selection_bias"


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def keep_selection_biases(new_params: dict, old_params: dict) -> dict:
    """new_params with every selection bias taken from old_params."""
    return jax.tree_util.tree_map_with_path(
        lambda path, new, old: old if _keys(path)[-1] == BIAS_NAME else new,
        new_params,
        old_params,
    )


def balanced_bias(bias_E, load_E, rate: float):
    """One balancing update of a bias [E] (or stacked [P, E]) by its loads (same shape)."""
    mean = jnp.mean(load_E, axis=-1, keepdims=True)
    return bias_E + jnp.asarray(rate, bias_E.dtype) * jnp.sign(mean - load_E).astype(bias_E.dtype)


def update_selection_biases(
    params: dict, loads: dict, rate: float, period: int, head: int = 0
) -> dict:
    """params with each decoder MoE layer's bias moved by its load (`loads`: layer id ->
    f32 [E]). Layouts of models/stack.py: `layers/<i>/ffn` (unrolled), or
    `layers/period/<j>/ffn` with row p = layer head + p * period + j (scanned behind `head`
    unrolled layers; its head and tail layers are dense), and the MTP modules' blocks
    `mtp/<k>/block/ffn` (loads[mtp_key(k)])."""

    def update(path, leaf):
        keys = _keys(path)
        if keys[-1] != BIAS_NAME:
            return leaf
        if keys[0] == "mtp":
            return balanced_bias(leaf, loads[mtp_key(int(keys[1]))], rate)
        if keys[0] != "layers" or keys[1] in (HEAD, TAIL):
            raise ValueError(f"bias balancing: unexpected selection bias at {'/'.join(keys)}")
        if keys[1] == PERIOD:
            j = int(keys[2])
            rows = [loads[head + p * period + j] for p in range(leaf.shape[0])]
            return balanced_bias(leaf, jnp.stack(rows), rate)
        return balanced_bias(leaf, loads[int(keys[1])], rate)

    return jax.tree_util.tree_map_with_path(update, params)
