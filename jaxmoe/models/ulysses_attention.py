"""Ulysses attention over the context axis (`model.context_strategy=ulysses`).

Where the all-gather and ring strategies bring the keys and values to each device's
queries, Ulysses (DeepSpeed-Ulysses) exchanges heads for sequence: one all-to-all turns each
device's [L / N tokens, H heads] of queries, keys and values into [L tokens, H / N heads],
every device attends the whole sequence with its share of the heads, and a second
all-to-all turns the outputs back. Each device then sends and receives 4 x (N - 1) / N of
its activations per layer whatever the length, and the attention of a device is ordinary
full-sequence attention, which the fused kernels run with their own causal mode.

The sequence a device receives is the concatenation of every device's block, in the
load-balanced layout (context_parallel.py); the attention reads each token's original
position from that layout's order, and positions travel with the tokens (rotary was
applied before the exchange), so nothing else needs reordering.

Grouped-query attention splits its K/V heads over the devices when they divide; otherwise
each K/V head is repeated r = N / gcd(K, N) times first (every one of the H / N query heads
of a device then finds its K/V head on the same device; r x the K/V traffic). The query
heads must divide over the axis.
"""

import math

import jax
import jax.numpy as jnp


def ulysses_refusal(num_heads: int, parts: int) -> str:
    """Why Ulysses cannot split `num_heads` query heads (per tensor shard) over `parts`."""
    if num_heads % parts:
        return (
            f"model.context_strategy=ulysses splits the query heads over mesh.context: "
            f"{num_heads} heads (per mesh.tensor shard) do not divide by {parts}"
        )
    return ""


def kv_repeats(kv_heads: int, parts: int) -> int:
    """How many times each K/V head is repeated so that the K/V heads divide over `parts`."""
    return parts // math.gcd(kv_heads, parts)


def ulysses_attention(attend, q_BLHd, k_BLKd, v_BLKd, seg_BL, sinks_H, *, axis: str, parts: int):
    """attend(q, k, v, seg, sinks) on the whole sequence with H / N heads per device.

    Inside shard_map: q/k/v [B, L/N, heads, d] are this device's tokens (split layout),
    seg_BL [B, L/N] their document ids (or None), sinks_H [H] (or None) every local head's
    sink. `attend` gets [B, L, H/N, d] (K/V [B, L, K'/N, d]), seg [B, L], the device's
    sinks [H/N], and returns [B, L, H/N, d]. Returns [B, L/N, H, d].
    """
    heads = q_BLHd.shape[2]
    reason = ulysses_refusal(heads, parts)
    if reason:
        raise ValueError(reason)
    repeats = kv_repeats(k_BLKd.shape[2], parts)
    if repeats > 1:  # consecutive copies: query head h still reads copy h // (G / r)
        k_BLKd = jnp.repeat(k_BLKd, repeats, axis=2)
        v_BLKd = jnp.repeat(v_BLKd, repeats, axis=2)

    def to_heads(a):  # [B, L/N, n, d] -> [B, L, n/N, d]: this device's heads, every token
        return jax.lax.all_to_all(a, axis, split_axis=2, concat_axis=1, tiled=True)

    q, k, v = to_heads(q_BLHd), to_heads(k_BLKd), to_heads(v_BLKd)
    if seg_BL is not None:
        seg_BL = jax.lax.all_gather(seg_BL, axis, axis=1, tiled=True)
    if sinks_H is not None:
        share = heads // parts
        start = jax.lax.axis_index(axis) * share
        sinks_H = jax.lax.dynamic_slice_in_dim(sinks_H, start, share)
    out = attend(q, k, v, seg_BL, sinks_H)
    # Back: [B, L, H/N, d] -> [B, L/N, H, d]
    return jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)
