"""Biases on every expert's projections (`model.moe.expert_bias`, GPT-OSS), through the
dispatch code that knows only kernels.

The gate/up biases ride on a ones column: x' = [x, 1] [.., D + 1] and wi' = [wi; b] [E, D + 1,
F], so x' wi' = x wi + b exactly (the extra products are by 1 and 0), for every dispatch and
under expert parallelism (the expert kernels are split along E only); wo gets a zero output
column, dropped afterwards. The down bias does not depend on the token's hidden units: it
is added outside, sum over the token's kept slots of weight * b_down[expert].
"""

import jax.numpy as jnp


def with_bias_column(x_BLD, experts, gate_bias_EF, up_bias_EF):
    """(x with a ones column [B, L, D + 1], (wi_0, wi_1, wo) widened to match)."""
    wi_0, wi_1, wo = experts
    ones_BL1 = jnp.ones((*x_BLD.shape[:-1], 1), x_BLD.dtype)
    x_BLD1 = jnp.concatenate([x_BLD, ones_BL1], axis=-1)
    wi_0 = jnp.concatenate([wi_0, gate_bias_EF[:, None, :].astype(wi_0.dtype)], axis=1)
    wi_1 = jnp.concatenate([wi_1, up_bias_EF[:, None, :].astype(wi_1.dtype)], axis=1)
    wo = jnp.concatenate([wo, jnp.zeros((*wo.shape[:2], 1), wo.dtype)], axis=2)
    return x_BLD1, (wi_0, wi_1, wo)


def down_bias(indices_BLK, weights_BLK, keep_BLK, bias_ED):
    """f32 [B, L, D]: each token's kept slots' combine weights times their experts' bias."""
    weights_BLK = jnp.where(keep_BLK, weights_BLK, 0).astype(jnp.float32)
    return jnp.einsum("blk,blkd->bld", weights_BLK, bias_ED.astype(jnp.float32)[indices_BLK])
