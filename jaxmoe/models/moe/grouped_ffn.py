"""Grouped expert FFN whose forward and backward cost follow the number of assignments.

The (row, expert) assignments are laid out by expert in a row buffer (ranks from a one-hot
cumsum for few experts, a stable argsort for many). A `scan` over experts takes one
expert's weight slabs at a time; inside it, `fori_loop`s with traced trip counts run one
dense [block, D] x [D, F] product per block of that expert's rows, so the work follows the
expert's row count. Autodiff of such loops would stack every iteration's activations in a
statically sized buffer and replay loops of the static maximum length, so the backward
pass is a `custom_vjp` running the same loops for dx, dW and the combine-weight gradient.

Why this shape (measured on the 2-core CPU; see benchmarks/moe_layer.py):
- Large blocks run the matmuls near the CPU's peak; 256 rows are as efficient per row as
  any larger size.
- Padding each expert's group to whole 256-row blocks wastes E * 128 rows on average, a
  fixed cost that held a 100%-single-expert layer at 0.62x of top-2 time. So an expert's
  rows run in blocks of `block_size`, and its remainder in tail blocks of block_size // 4
  (under block_size // 4 rows of padding per expert): 0.53x. Four halving tail sizes
  were no faster and doubled the compile time (each loop costs ~0.15 s to compile).
- Small blocks pay per-block overheads (weight slab reads, dW read-modify-write) that a
  single loop over the blocks of all experts pays every block; the outer scan over
  experts pays them once per expert, which keeps the tail blocks cheap.
- The backward recomputes each block's hidden activations: saving them in row buffers cost
  more in memory traffic than the two recomputed products (top-2 time 0.15 s vs 0.22 s).
"""

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.models.moe.glu import gated_hidden
from jaxmoe.models.moe.grouping import block_rows, tail_rows

Activation = Callable[[jax.Array], jax.Array]


class ExpertRows(NamedTuple):
    """Assignments laid out by expert: expert e owns rows [offset_E[e], + counts_E[e]).

    row_src_R: index into the input rows for each buffer row (N for padding rows).
    row_weight_R: combine weight of each buffer row (0 for padding rows).
    """

    row_src_R: jax.Array
    row_weight_R: jax.Array
    offset_E: jax.Array
    counts_E: jax.Array


# Above this many (assignment, expert) pairs the one-hot cumsum's [A, E] buffers cost more
# than a stable argsort: on the 2-core host (loaded) A=8192, E=8: one-hot 0.7 ms, sort
# 1.8 ms; E=32: 3.2 vs 1.9 ms; A=32768, E=128 (4096 tokens top-8): 576 vs 48 ms.
ONE_HOT_RANKS_MAX = 2**17


def expert_ranks(expert_A: jax.Array, valid_A: jax.Array, num_experts: int):
    """(rank_A, counts_E): each valid assignment's rank among its expert's, in order.

    Few experts: a one-hot cumsum, linear in A * E. Many (fine-grained experts): a stable
    argsort by expert, whose position minus the expert's offset is the rank.
    Invalid assignments get rank -1.
    """
    num_assign = expert_A.shape[0]
    if num_assign * num_experts > ONE_HOT_RANKS_MAX:
        key_A = jnp.where(valid_A, expert_A, num_experts).astype(jnp.int32)
        counts_E = jnp.bincount(key_A, length=num_experts + 1)[:num_experts].astype(jnp.int32)
        order_A = jnp.argsort(key_A, stable=True)
        position_A = (
            jnp.zeros(num_assign, jnp.int32)
            .at[order_A]
            .set(jnp.arange(num_assign, dtype=jnp.int32))
        )
        offset_E = jnp.cumsum(counts_E) - counts_E
        rank_A = position_A - offset_E[jnp.minimum(key_A, num_experts - 1)]
        return jnp.where(valid_A, rank_A, -1), counts_E
    onehot_AE = (expert_A[:, None] == jnp.arange(num_experts)) & valid_A[:, None]
    onehot_AE = onehot_AE.astype(jnp.int32)
    counts_E = onehot_AE.sum(axis=0)
    rank_A = jnp.sum(jnp.cumsum(onehot_AE, axis=0) * onehot_AE, axis=1) - 1
    return rank_A, counts_E


def block_sizes(block_size: int) -> tuple[int, ...]:
    """(block_size, block_size // 4): full blocks, then tail blocks for the remainder."""
    tail = tail_rows(block_size)
    return (block_size, tail) if tail < block_size else (block_size,)


def expert_layout(
    src_A: jax.Array,
    expert_A: jax.Array,
    weight_A: jax.Array,
    valid_A: jax.Array,
    *,
    num_rows: int,
    num_experts: int,
    pad_to: int,
) -> ExpertRows:
    """Lays out assignments (input row src_A -> expert expert_A, weight weight_A) by expert.

    Expert e's rows follow expert e - 1's, its group padded to a multiple of `pad_to` rows
    (the smallest block size) so that its last block never reads the next expert's rows.
    """
    num_assign = src_A.shape[0]
    rank_A, counts_E = expert_ranks(expert_A, valid_A, num_experts)
    padded_E = (counts_E + pad_to - 1) // pad_to * pad_to
    offset_E = jnp.cumsum(padded_E) - padded_E
    size = num_assign + num_experts * pad_to  # static bound on the padded total
    row_A = jnp.where(valid_A, offset_E[expert_A] + rank_A, size)  # size: dropped below
    row_src_R = jnp.full((size,), num_rows, jnp.int32)
    row_src_R = row_src_R.at[row_A].set(src_A.astype(jnp.int32), mode="drop")
    row_weight_R = jnp.zeros((size,), weight_A.dtype).at[row_A].set(weight_A, mode="drop")
    return ExpertRows(row_src_R, row_weight_R, offset_E, counts_E)


def _over_blocks(sizes, offset, count, block_fn, carry):
    """Runs block_fn(start, size, carry) over one expert's rows, largest blocks first."""
    start, left = offset, count
    for i, size in enumerate(sizes):
        last = i == len(sizes) - 1
        num = (left + size - 1) // size if last else left // size

        def body(j, carry, start=start, size=size):
            return block_fn(start + j * size, size, carry)

        carry = jax.lax.fori_loop(0, num, body, carry)
        start, left = start + num * size, left - num * size
    return carry


def _gather_rows(rows: ExpertRows, x_ND, start, size):
    src = jax.lax.dynamic_slice_in_dim(rows.row_src_R, start, size)
    weight = jax.lax.dynamic_slice_in_dim(rows.row_weight_R, start, size)
    # Padding rows point one past the end: they read zeros and their writes are dropped.
    return src, weight, x_ND.at[src].get(mode="fill", fill_value=0)


def _forward(act, sizes, x_ND, rows, wi_0, wi_1, wo):
    acc = jnp.float32

    def expert(y_ND, per_expert):
        offset, count, wi_0_DF, wi_1_DF, wo_FD = per_expert

        def block(start, size, y_ND):
            src, weight, x_bD = _gather_rows(rows, x_ND, start, size)
            hidden_bF = gated_hidden(act, jnp.dot(x_bD, wi_0_DF), jnp.dot(x_bD, wi_1_DF))
            out_bD = jnp.dot(hidden_bF, wo_FD, preferred_element_type=acc)
            return y_ND.at[src].add(out_bD * weight[:, None].astype(acc), mode="drop")

        return _over_blocks(sizes, offset, count, block, y_ND), None

    per_expert = (rows.offset_E, rows.counts_E, wi_0, wi_1, wo)
    y_ND, _ = jax.lax.scan(expert, jnp.zeros(x_ND.shape, acc), per_expert)
    return y_ND.astype(x_ND.dtype)


def _backward(act, sizes, x_ND, rows, wi_0, wi_1, wo, dy_ND):
    acc = jnp.float32
    dy_ND = dy_ND.astype(x_ND.dtype)

    def expert(carry, per_expert):
        offset, count, wi_0_DF, wi_1_DF, wo_FD = per_expert

        def block(start, size, carry):
            dx_ND, dweight_R, (dwi_0, dwi_1, dwo) = carry
            src, weight, x_bD = _gather_rows(rows, x_ND, start, size)
            dy_bD = dy_ND.at[src].get(mode="fill", fill_value=0)
            hidden_bF, hidden_vjp = jax.vjp(
                partial(gated_hidden, act), jnp.dot(x_bD, wi_0_DF), jnp.dot(x_bD, wi_1_DF)
            )
            # y += weight * (hidden wo), so d weight = <dy, hidden wo> = <dy wo^T, hidden>.
            dy_wo_bF = jnp.dot(dy_bD, wo_FD.T)
            dweight_b = jnp.sum(dy_wo_bF.astype(acc) * hidden_bF.astype(acc), axis=1)
            dweight_R = jax.lax.dynamic_update_slice_in_dim(dweight_R, dweight_b, start, 0)
            w_b1 = weight[:, None].astype(x_bD.dtype)
            dwo += jnp.dot(hidden_bF.T, dy_bD * w_b1, preferred_element_type=acc)
            dhidden_bF = dy_wo_bF * w_b1
            dgate_bF, dup_bF = hidden_vjp(dhidden_bF)
            dwi_0 += jnp.dot(x_bD.T, dgate_bF, preferred_element_type=acc)
            dwi_1 += jnp.dot(x_bD.T, dup_bF, preferred_element_type=acc)
            dx_bD = jnp.dot(dgate_bF, wi_0_DF.T, preferred_element_type=acc)
            dx_bD += jnp.dot(dup_bF, wi_1_DF.T, preferred_element_type=acc)
            dx_ND = dx_ND.at[src].add(dx_bD, mode="drop")
            return dx_ND, dweight_R, (dwi_0, dwi_1, dwo)

        dws = tuple(jnp.zeros(w.shape, acc) for w in (wi_0_DF, wi_1_DF, wo_FD))
        dx_ND, dweight_R, dws = _over_blocks(sizes, offset, count, block, (*carry, dws))
        return (dx_ND, dweight_R), tuple(d.astype(wi_0_DF.dtype) for d in dws)

    init = (jnp.zeros(x_ND.shape, acc), jnp.zeros(rows.row_weight_R.shape, acc))
    per_expert = (rows.offset_E, rows.counts_E, wi_0, wi_1, wo)
    (dx_ND, dweight_R), (dwi_0, dwi_1, dwo) = jax.lax.scan(expert, init, per_expert)
    drows = ExpertRows(None, dweight_R.astype(rows.row_weight_R.dtype), None, None)
    return dx_ND.astype(x_ND.dtype), drows, dwi_0, dwi_1, dwo


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _grouped_ffn(act, sizes, x_ND, rows, wi_0, wi_1, wo):
    return _forward(act, sizes, x_ND, rows, wi_0, wi_1, wo)


def _grouped_ffn_fwd(act, sizes, x_ND, rows, wi_0, wi_1, wo):
    return _forward(act, sizes, x_ND, rows, wi_0, wi_1, wo), (x_ND, rows, wi_0, wi_1, wo)


def _grouped_ffn_bwd(act, sizes, residuals, dy_ND):
    return _backward(act, sizes, *residuals, dy_ND)


_grouped_ffn.defvjp(_grouped_ffn_fwd, _grouped_ffn_bwd)


def grouped_ffn_blocks(
    x_ND: jax.Array,
    src_A: jax.Array,
    expert_A: jax.Array,
    weight_A: jax.Array,
    valid_A: jax.Array,
    wi_0_EDF: jax.Array,
    wi_1_EDF: jax.Array,
    wo_EFD: jax.Array,
    *,
    act: Activation,
    block_size: int,
) -> jax.Array:
    """y_ND[n] = sum over valid a with src_A[a] = n of weight_A[a] * FFN_{expert_A[a]}(x_ND[n]).

    FFN_e(x) = act(x wi_0[e]) * (x wi_1[e]) wo[e]. Differentiable in x, weight_A and the
    expert weights; the cost follows the number of valid assignments.
    """
    x_ND = jnp.asarray(x_ND)
    num_experts = wi_0_EDF.shape[0]
    # Few assignments per expert (decoding, a small shard, many fine-grained experts): blocks
    # shrink to an expert's average share of rows, or padding would outweigh the rows.
    # Decoding 8 sequences with 8 experts (2 rows each) ran 64-row blocks at 263-357 ms per
    # token; 2-row blocks take 96 ms (loaded 2-core host, benchmarks/decode_peer.py's model).
    block_size = block_rows(src_A.shape[0], num_experts, block_size)
    sizes = block_sizes(block_size)
    rows = expert_layout(
        src_A,
        expert_A,
        weight_A,
        valid_A,
        num_rows=x_ND.shape[0],
        num_experts=num_experts,
        pad_to=sizes[-1],
    )
    return _grouped_ffn(act, sizes, x_ND, rows, wi_0_EDF, wi_1_EDF, wo_EFD)
