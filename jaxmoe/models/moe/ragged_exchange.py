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
to them (dropless: further rounds through the same buffer; capacity: dropped, counted).

XLA:CPU has no ragged-all-to-all, so there `ragged_all_to_all` runs `reference`, the same
semantics from a dense all_to_all and masks (tests compare the two exchange paths on CPU).
"""

import functools
import math

import jax
import jax.numpy as jnp

from jaxmoe.models.moe.dispatch import grouped_ffn
from jaxmoe.models.moe.grouped_ffn import expert_ranks
from jaxmoe.models.quantization import NONE


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


def _window(offset, count, first: jax.Array, rows: int):
    """Start and size of the part of [offset, offset + count) in [first, first + rows)."""
    start = jnp.clip(first - offset, 0, count)
    return start, jnp.clip(first + rows - offset, 0, count) - start


def _round(acc_AD, send_x, c, experts, first, *, rows, axis, act, impl, bs, quant):
    """One exchange of receive-stream rows [first, first + rows): acc_AD [A, D] with the
    expert outputs of those rows written at their send-buffer rows (others unchanged)."""
    send_start_J, send_size_J = _window(c["out_offset"], c["send_count"], first, rows)
    recv_start_I, recv_size_I = _window(c["recv_offset"], c["recv_count"], first, rows)
    # Each received row's local expert: stream segments (source, local expert) in order.
    seg_end = jnp.cumsum(c["recv_counts"].reshape(-1))
    r_R = jnp.arange(rows, dtype=jnp.int32)
    local = c["recv_counts"].shape[1]
    expert_R = jnp.searchsorted(seg_end, first + r_R, side="right") % local
    dim = send_x.shape[-1]
    recv_x = ragged_all_to_all(
        send_x,
        jnp.zeros((rows, dim), send_x.dtype),
        c["send_offset"] + send_start_J,
        send_size_J,
        c["out_offset"] + send_start_J - first,
        recv_size_I,
        axis=axis,
    )
    out_RD = grouped_ffn(
        recv_x,
        r_R,
        expert_R.astype(jnp.int32),
        jnp.ones((rows,), jnp.float32),
        first + r_R < seg_end[-1],
        experts,
        act=act,
        impl=impl,
        block_size=bs,
        quant=quant,
    ).astype(send_x.dtype)
    return ragged_all_to_all(
        out_RD,
        acc_AD,
        c["recv_offset"] + recv_start_I - first,
        recv_size_I,
        c["src_offset"] + recv_start_I,
        send_size_J,
        axis=axis,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _round_if(rows, axis, act, impl, bs, quant, acc_AD, send_x, experts, c, first, longest):
    """`_round` when first < longest, else acc_AD unchanged (a round past every stream).

    Its own VJP so that the backward pass recomputes the round inside the same condition:
    the residuals are the inputs, loop invariants but for `first`. Differentiating a cond
    makes the branch's residuals (the expert weights, the received rows) outputs of the
    cond, which a scan over rounds stacks and keeps from the forward to the backward pass:
    more HBM than the padded exchange (issue 17).
    """
    options = dict(rows=rows, axis=axis, act=act, impl=impl, bs=bs, quant=quant)
    return jax.lax.cond(
        first < longest,
        lambda a: _round(a, send_x, c, experts, first, **options),
        lambda a: a,
        acc_AD,
    )


def _round_if_fwd(rows, axis, act, impl, bs, quant, acc_AD, send_x, experts, c, first, longest):
    args = (acc_AD, send_x, experts, c, first, longest)
    out = _round_if(rows, axis, act, impl, bs, quant, *args)
    return out, (send_x, experts, c, first, longest)


def _round_if_bwd(rows, axis, act, impl, bs, quant, residuals, ct_AD):
    send_x, experts, c, first, longest = residuals
    options = dict(rows=rows, axis=axis, act=act, impl=impl, bs=bs, quant=quant)

    def recompute(ct_AD):
        # The round is linear in acc_AD, so its VJP does not depend on acc_AD's value.
        def round_of(acc_AD, send_x, experts):
            return _round(acc_AD, send_x, c, experts, first, **options)

        _, vjp = jax.vjp(round_of, jnp.zeros_like(ct_AD), send_x, experts)
        return vjp(ct_AD)

    def skipped(ct_AD):
        return ct_AD, jnp.zeros_like(send_x), jax.tree.map(jnp.zeros_like, experts)

    ct_acc, ct_send, ct_experts = jax.lax.cond(first < longest, recompute, skipped, ct_AD)
    return ct_acc, ct_send, ct_experts, None, None, None


_round_if.defvjp(_round_if_fwd, _round_if_bwd)


def ragged_ep(
    x_BLD,
    indices_BLK,
    weights_BLK,
    keep_BLK,
    experts,
    *,
    ep,
    axis,
    act,
    impl,
    bs,
    factor,
    dropless,
    quant=NONE,
):
    """(y_BLD, overflow_BLK): the MoE FFN with a routing-sized exchange (runs per device).

    overflow_BLK marks kept assignments past the bounded receive buffer's first round. With
    `dropless` further rounds of the same buffer carry them (a scan over at most
    ceil(worst / rows) rounds, skipped once every device's stream is done); otherwise they
    are dropped.
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
    # An assignment overflows if its place in its receiver's stream is past `rows`.
    dest_A = expert_A // local
    stream_A = c["out_offset"][dest_A] + pos_A - c["send_offset"][dest_A]
    overflow_A = valid_A & (stream_A >= rows)
    options = dict(rows=rows, axis=axis, act=act, impl=impl, bs=bs, quant=quant)
    acc_AD = jnp.zeros_like(send_x)
    if not dropless or rows == worst:
        back_AD = _round(acc_AD, send_x, c, experts, jnp.int32(0), **options)
        fits_A = valid_A & ~overflow_A
    else:
        # Dropless: the longest receive stream of the group in rounds of `rows` rows, all
        # devices together; rounds past it are skipped (no traffic, no compute).
        longest = jax.lax.pmax(c["recv_count"].sum(), axis)

        def step(acc_AD, first):
            args = (acc_AD, send_x, experts, c, first, longest)
            return _round_if(rows, axis, act, impl, bs, quant, *args), None

        starts = jnp.arange(0, worst, rows, dtype=jnp.int32)
        back_AD, _ = jax.lax.scan(step, acc_AD, starts)
        fits_A = valid_A
    out_AD = back_AD.at[pos_A].get(mode="fill", fill_value=0).astype(jnp.float32)
    weight_A = jnp.where(fits_A, weights_BLK.reshape(-1), 0).astype(jnp.float32)
    y_TD = jnp.sum((out_AD * weight_A[:, None]).reshape(num_tokens, slots, dim), axis=1)
    y_BLD = y_TD.reshape(batch, length, dim).astype(x_BLD.dtype)
    return y_BLD, overflow_A.reshape(indices_BLK.shape)
