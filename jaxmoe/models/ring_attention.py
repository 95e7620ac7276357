"""Ring attention over the context axis (`model.context_strategy=ring`, context_parallel.py).

Instead of gathering every key and value, each device keeps its own block and passes it to
the next device around the axis (`ppermute`) N - 1 times; after each pass its queries
attend to the block in hand, and an online softmax (running maximum m, sum l and weighted
values o, in f32) merges the blocks as they come. Every device then holds one block of keys
and values at a time (2 L / N tokens' worth with the one in flight) instead of all L, and
the compiler may overlap each pass with the block's products. The masks, the query pieces
and the arithmetic per (query, key) pair are the all-gather strategy's; only the order in
which the keys are summed differs.
"""

import jax
import jax.numpy as jnp

from jaxmoe.models.attention_math import piece_queries

NEG_INF = -1e30  # finite, as attention_math.NEG_INF: a fully masked block leaves m, l, o alone


def ring_attention(
    q_BLHd, k_BSKd, v_BSKd, q_at_L, k_at_S, seg_q, seg_k, *, scale, window, sinks_H, axis, parts
):
    """One device's queries against the keys of all `parts` devices of `axis`, passed around.

    q_at_L / k_at_S: the original token indices of the local queries and of the local key
    block; seg_q / seg_k: their document ids (None: one document). Runs inside shard_map.
    """
    b, lq, h, d = q_BLHd.shape
    kv_heads = k_BSKd.shape[2]
    groups = h // kv_heads
    chunk = piece_queries(lq, h, k_BSKd.shape[1])
    pieces = lq // chunk

    def by_piece(a):  # [B, L, ...] -> [pieces, B, chunk, ...]
        return jnp.moveaxis(a.reshape(b, pieces, chunk, *a.shape[2:]), 1, 0)

    q_P = by_piece(q_BLHd).reshape(pieces, b, chunk, kv_heads, groups, d)
    at_P = q_at_L.reshape(pieces, chunk)
    seg_P = None if seg_q is None else by_piece(seg_q)

    def piece(xs, block):
        (m, l, o), q_C, at_C, seg_C = xs
        k_S, v_S, at_S, seg_S = block
        logits = jnp.einsum("bckgd,bskd->bkgcs", q_C, k_S, preferred_element_type=jnp.float32)
        if scale is not None:
            logits = logits * scale
        allowed_CS = at_S[None, :] <= at_C[:, None]
        if window:
            allowed_CS &= at_S[None, :] > at_C[:, None] - window
        mask = allowed_CS[None, None, None]
        if seg_C is not None:
            mask = mask & (seg_C[:, :, None] == seg_S[:, None, :])[:, None, None]
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, logits, NEG_INF), axis=-1))
        p = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkgcs,bskd->bkgcd", p.astype(v_S.dtype), v_S)
        o = o * correction[..., None] + pv.astype(jnp.float32)
        return m_new, l, o

    def absorb(stats, block):
        """Every query piece's running statistics after one key block (pieces in a loop,
        each rematerialised: no [C, S] scores are kept for the backward pass)."""
        step = jax.checkpoint(lambda xs: piece(xs, block))
        return jax.lax.map(step, (stats, q_P, at_P, seg_P))

    shift = [(j, (j + 1) % parts) for j in range(parts)]

    def ring_step(carry, _):
        stats, block = carry
        stats = absorb(stats, block)
        block = jax.tree.map(lambda a: jax.lax.ppermute(a, axis, shift), block)
        return (stats, block), None

    shape = (pieces, b, kv_heads, groups, chunk)
    stats = (
        jnp.full(shape, NEG_INF, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, d), jnp.float32),
    )
    # The statistics vary over the devices like the queries and keys they come from, and the
    # loop carry must say so from the start: a zero taken from both carries their axes.
    zero = (q_BLHd.reshape(-1)[0] * 0 + k_BSKd.reshape(-1)[0] * 0).astype(jnp.float32)
    stats = jax.tree.map(lambda a: a + zero, stats)
    block = (k_BSKd, v_BSKd, k_at_S, seg_k)
    # N - 1 passes, then the last block without passing it on.
    (stats, block), _ = jax.lax.scan(ring_step, (stats, block), None, length=parts - 1)
    m, l, o = absorb(stats, block)
    if sinks_H is not None:  # one more logit per head in each denominator, no value
        sink = sinks_H.astype(jnp.float32).reshape(1, 1, kv_heads, groups, 1)
        top = jnp.maximum(m, sink)
        correction = jnp.exp(m - top)
        l = l * correction + jnp.exp(sink - top)
        o = o * correction[..., None]
    out = (o / l[..., None]).astype(q_BLHd.dtype)  # [pieces, B, K, G, chunk, d]
    return out.transpose(1, 0, 4, 2, 3, 5).reshape(b, lq, h, d)
