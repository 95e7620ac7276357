"""The expert-parallel exchange sized to the routing: `jax.lax.ragged_all_to_all`.

Each device sends every expert device exactly the rows its tokens were assigned there, so
the bytes on the wire follow the assignments made (an adaptive gate's one-expert tokens
send one row, not two). Per MoE layer, inside shard_map over the "expert" axis:
1. counts first: an all_to_all of the per-(device, local expert) assignment counts tells
   each receiver how many rows every source will send; the receiver lays sources out one
   after another and an all_to_all of those offsets tells each sender where its rows land;
2. tokens travel with `ragged_all_to_all` into a receive buffer of `rows` rows, are run
   through the local experts (dispatch.grouped_ffn: `ragged_dot` on GPU/TPU), and travel
   back to the send buffer's positions with a second `ragged_all_to_all`.

The receive buffer is bounded: rows = ceil(ep_buffer_factor * T * K) for T local tokens and
K slots (the load of a perfectly balanced router), at most the worst case ep * T *
min(K, E_local). Rows past the bound overflow. See docs/expert_exchange.md for what happens
to them (dropless: the layer re-runs with the worst-case bound; capacity: dropped, counted).

XLA:CPU has no ragged-all-to-all, so there `ragged_all_to_all` runs `reference`, the same
semantics from a dense all_to_all and masks (tests compare the two exchange paths on CPU).
"""

import math

import jax
import jax.numpy as jnp

from jaxmoe.models.dispatch import grouped_ffn
from jaxmoe.models.dispatch_blocks import expert_ranks


def reference(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis):
    """`jax.lax.ragged_all_to_all` with one slice per device, from all_to_all + masks.

    operand [M, ...], output [R, ...], the rest [ep] int32. Sends rows
    input_offsets[j] : + send_sizes[j] to device j, where they land at output_offsets[j];
    rows of `output` nobody writes keep their value. Moves ep * M rows: a test reference.
    """
    num_rows = operand.shape[0]
    i_M = jnp.arange(num_rows, dtype=jnp.int32)
    take_JM = jnp.where(i_M < send_sizes[:, None], input_offsets[:, None] + i_M, num_rows)
    send = operand.at[take_JM].get(mode="fill", fill_value=0)
    recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=False)  # [ep, M, ...]: row i from i
    where_I = jax.lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)
    put_IM = jnp.where(i_M < recv_sizes[:, None], where_I[:, None] + i_M, output.shape[0])
    flat = recv.reshape(-1, *operand.shape[1:])
    return output.at[put_IM.reshape(-1)].set(flat, mode="drop")


def ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis
):
    """The primitive on GPU/TPU, `reference` on CPU (chosen when the program is lowered)."""
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)

    def native(*a):
        return jax.lax.ragged_all_to_all(*a, axis_name=axis)

    def emulated(*a):
        return reference(*a, axis=axis)

    return jax.lax.platform_dependent(*args, cpu=emulated, default=native)


def receive_rows(buffer_factor: float, num_tokens: int, slots: int, ep: int, local: int):
    """(rows, worst): buffer_factor x the balanced load T * K within [1, worst], and the
    worst case ep * T * min(K, E_local) (every source's every assignment here)."""
    worst = ep * num_tokens * min(slots, local)
    return max(1, min(worst, math.ceil(buffer_factor * num_tokens * slots))), worst


def exchange_counts(counts_JX, axis: str) -> dict:
    """The counts, then the offsets, of both trips (three small all_to_alls).

    counts_JX [ep, E_local]: this device's assignments to device j's local expert x.
    A receiver lays its sources out in device order, each sorted by local expert.
    """
    send_count_J = counts_JX.sum(axis=1)
    send_offset_J = jnp.cumsum(send_count_J) - send_count_J
    recv_counts_IX = jax.lax.all_to_all(counts_JX, axis, 0, 0, tiled=False)
    recv_count_I = recv_counts_IX.sum(axis=1)
    recv_offset_I = jnp.cumsum(recv_count_I) - recv_count_I
    return dict(
        send_count=send_count_J,
        send_offset=send_offset_J,
        recv_counts=recv_counts_IX,
        recv_count=recv_count_I,
        recv_offset=recv_offset_I,
        # Where my rows start on device j; where device i's rows sit in its send buffer.
        out_offset=jax.lax.all_to_all(recv_offset_I, axis, 0, 0, tiled=True),
        src_offset=jax.lax.all_to_all(send_offset_J, axis, 0, 0, tiled=True),
    )


def send_sizes(c: dict, rows: int):
    """Rows sent to each device when receivers hold `rows` rows (the rest overflow)."""
    return jnp.clip(rows - c["out_offset"], 0, c["send_count"])


def _exchange_ffn(send_x, c, rows, experts, *, axis, act, impl, bs):
    """send_x [A, D] (sorted by expert) -> expert outputs [A, D] at the same rows."""
    recv_size_I = jnp.clip(rows - c["recv_offset"], 0, c["recv_count"])
    send_size_J = send_sizes(c, rows)
    # Each received row's local expert: segments (source, local expert), in that order.
    seg_end = jnp.cumsum(c["recv_counts"].reshape(-1))
    r_R = jnp.arange(rows, dtype=jnp.int32)
    local = c["recv_counts"].shape[1]
    expert_R = (jnp.searchsorted(seg_end, r_R, side="right") % local).astype(jnp.int32)
    valid_R = r_R < seg_end[-1]
    dim = send_x.shape[-1]
    recv_x = ragged_all_to_all(
        send_x,
        jnp.zeros((rows, dim), send_x.dtype),
        c["send_offset"],
        send_size_J,
        c["out_offset"],
        recv_size_I,
        axis=axis,
    )
    out_RD = grouped_ffn(
        recv_x,
        r_R,
        expert_R,
        jnp.ones((rows,), jnp.float32),
        valid_R,
        experts,
        act=act,
        impl=impl,
        block_size=bs,
    ).astype(send_x.dtype)
    return ragged_all_to_all(
        out_RD,
        jnp.zeros_like(send_x),
        c["recv_offset"],
        recv_size_I,
        c["src_offset"],
        send_size_J,
        axis=axis,
    )


def ragged_ep(
    x_BLD, indices_BLK, weights_BLK, keep_BLK, experts, *, ep, axis, act, impl, bs, factor, dropless
):
    """(y_BLD, overflow_BLK): the MoE FFN with a routing-sized exchange (runs per device).

    overflow_BLK marks kept assignments that did not fit the bounded receive buffer. With
    `dropless` the layer then re-runs with the worst-case bound (same result, one branch of
    a lax.cond chosen by every device of the expert group); otherwise they are dropped.
    """
    batch, length, dim = x_BLD.shape
    slots = indices_BLK.shape[-1]
    local = experts[0].shape[0]
    num_tokens = batch * length
    num_assign = num_tokens * slots
    expert_A = indices_BLK.reshape(-1)
    valid_A = keep_BLK.reshape(-1)
    # Send buffer sorted by global expert = by (device, local expert).
    rank_A, counts_E = expert_ranks(expert_A, valid_A, ep * local)
    offset_E = jnp.cumsum(counts_E) - counts_E
    pos_A = jnp.where(valid_A, offset_E[expert_A] + rank_A, num_assign)
    token_A = jnp.repeat(jnp.arange(num_tokens, dtype=jnp.int32), slots)
    src_S = jnp.full((num_assign,), num_tokens, jnp.int32).at[pos_A].set(token_A, mode="drop")
    send_x = x_BLD.reshape(num_tokens, dim).at[src_S].get(mode="fill", fill_value=0)

    rows, worst = receive_rows(factor, num_tokens, slots, ep, local)
    c = exchange_counts(counts_E.reshape(ep, local), axis)
    dest_A = expert_A // local
    overflow_A = valid_A & (pos_A - c["send_offset"][dest_A] >= send_sizes(c, rows)[dest_A])

    def run(r):
        def exchange(send_x, c, experts):
            return _exchange_ffn(send_x, c, r, experts, axis=axis, act=act, impl=impl, bs=bs)

        return exchange

    if dropless and rows < worst:
        any_overflow = jax.lax.psum(jnp.sum(overflow_A.astype(jnp.int32)), axis) > 0
        # Rematerialised branches: a differentiated cond keeps the residuals of both
        # branches alive (each returns zeros for the other's), which would make the
        # bounded buffer cost more memory than the worst case alone; this way the
        # residuals are the branch inputs, and the backward pass re-runs the taken branch.
        branches = [jax.checkpoint(run(r)) for r in (rows, worst)]
        back_AD = jax.lax.cond(any_overflow, branches[1], branches[0], send_x, c, experts)
        fits_A = valid_A
    else:
        back_AD = run(rows)(send_x, c, experts)
        fits_A = valid_A & ~overflow_A
    out_AD = back_AD.at[pos_A].get(mode="fill", fill_value=0).astype(jnp.float32)
    weight_A = jnp.where(fits_A, weights_BLK.reshape(-1), 0).astype(jnp.float32)
    y_TD = jnp.sum((out_AD * weight_A[:, None]).reshape(num_tokens, slots, dim), axis=1)
    y_BLD = y_TD.reshape(batch, length, dim).astype(x_BLD.dtype)
    return y_BLD, overflow_A.reshape(indices_BLK.shape)
