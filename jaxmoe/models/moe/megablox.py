"""`model.moe.dispatch=megablox`: the expert-sorted rows through the megablox grouped matmul.

The same layout as the "ragged" dispatch (assignments sorted by expert, dispatch.py), with
each of the three expert products run by the Pallas TPU kernel
`jax.experimental.pallas.ops.tpu.megablox.gmm` (its custom VJP: gmm for the input
gradient, tgmm for the weight gradient) instead of `jax.lax.ragged_dot`.

The kernel tiles rows in blocks of `tm` and leaves rows outside every group unwritten, so
the rows are padded to a whole number of tiles and every row past the assignments goes to
one extra group that has no weights: given E + 1 group sizes and E weight groups, gmm zeroes
the rows of the groups it has no weights for (its expert-sharding path), in the forward and
in both gradients.

Lowered for TPU the kernel is Mosaic; lowered for CPU it runs in Pallas' interpret mode
(correct and slow: for tests), on GPU the dispatch is `ragged_dot`'s.
"""

import functools

import jax
import jax.numpy as jnp

from jaxmoe.models.moe.glu import gated_hidden
from jaxmoe.models.moe.grouped_ffn import expert_ranks

# Tile sizes (rows, contraction, output columns); smaller dims take the whole dim.
TILE_ROWS = 512
TILE_K = 1024
TILE_N = 1024
ROW_ALIGN = 8  # a TPU sublane: a row tile smaller than TILE_ROWS is a multiple of this


def row_tile(rows: int) -> int:
    """The row tile for `rows` rows: TILE_ROWS, or the rows rounded up to ROW_ALIGN."""
    return min(TILE_ROWS, -(-rows // ROW_ALIGN) * ROW_ALIGN)


def _gmm(lhs_MK, rhs_EKN, sizes_G, tm: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    tiling = (tm, min(TILE_K, lhs_MK.shape[1]), min(TILE_N, rhs_EKN.shape[2]))
    return gmm(lhs_MK, rhs_EKN, sizes_G, lhs_MK.dtype, tiling, None, None, False, interpret)


def grouped_dot(lhs_MK, rhs_EKN, sizes_G, tm: int):
    """out[m] = lhs[m] @ rhs[group of m] for rows of groups < E, 0 for the last group's;
    sizes_G [E + 1] int32 sums to M (a multiple of tm)."""

    def run(interpret, lhs, rhs, sizes):
        return _gmm(lhs, rhs, sizes, tm, interpret)

    return jax.lax.platform_dependent(
        lhs_MK,
        rhs_EKN,
        sizes_G,
        cpu=functools.partial(run, True),
        tpu=functools.partial(run, False),
        default=lambda lhs, rhs, sizes: jax.lax.ragged_dot(lhs, rhs, sizes[:-1]),
    )


def megablox_ffn(x_ND, src_A, expert_A, weight_A, valid_A, experts, *, act):
    """dispatch.grouped_ffn's "megablox" implementation (same signature and result)."""
    wi_0, wi_1, wo = experts
    num_rows, num_assign = x_ND.shape[0], src_A.shape[0]
    num_experts = wi_0.shape[0]
    rank_A, counts_E = expert_ranks(expert_A, valid_A, num_experts)
    offset_E = jnp.cumsum(counts_E) - counts_E
    tm = row_tile(num_assign)
    padded = -(-num_assign // tm) * tm
    row_A = jnp.where(valid_A, offset_E[expert_A] + rank_A, padded)
    row_src_R = jnp.full((padded,), num_rows, jnp.int32)
    row_src_R = row_src_R.at[row_A].set(src_A.astype(jnp.int32), mode="drop")
    x_RD = x_ND.at[row_src_R].get(mode="fill", fill_value=0)
    counts_E = counts_E.astype(jnp.int32)
    sizes_G = jnp.concatenate([counts_E, (padded - jnp.sum(counts_E))[None]])
    hidden_RF = gated_hidden(
        act, grouped_dot(x_RD, wi_0, sizes_G, tm), grouped_dot(x_RD, wi_1, sizes_G, tm)
    )
    out_RD = grouped_dot(hidden_RF, wo, sizes_G, tm)
    out_AD = out_RD.at[row_A].get(mode="fill", fill_value=0)
    weight_A = jnp.where(valid_A, weight_A, 0).astype(x_ND.dtype)
    return jnp.zeros_like(x_ND).at[src_A].add(out_AD * weight_A[:, None])
