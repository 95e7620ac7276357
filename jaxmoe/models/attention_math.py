"""Softmax attention as plain functions, below the Attention module and the context-parallel
strategies that both call them: the grouped einsum (K/V shared by groups of query heads),
blocked causal attention for the CPU backend, and the query-chunked, rematerialised path.
"""

import jax
import jax.numpy as jnp

from jaxmoe.models.attention_window import grouped_sinks, softmax_with_sinks

NEG_INF = -1e30  # finite: a fully masked row must give zeros, not NaNs
AUTO = -1  # `causal_block` setting: blocked on CPU, dense elsewhere (see resolve_causal_block)


def same_segment(query_segments_BL, key_segments_BS):
    """bool [B, L, S]: whether query i and key j lie in the same document of a packed row
    (segment ids, batch_fields.py; padding, segment 0, sees only padding)."""
    return query_segments_BL[:, :, None] == key_segments_BS[:, None, :]


def resolve_causal_block(setting: int, length: int) -> int:
    """Query block size of blocked causal attention for a sequence of `length`; 0 = dense.

    AUTO picks blocks on the CPU backend only. There XLA runs the [.., L, S] softmax and the
    small per-head matmuls far below the machine's speed; query blocks that skip the keys
    after the block measured 2.3x (L=256, blocks of 32) to 3.4x (L=1024, blocks of 64) faster
    forward + backward than the dense path (benchmarks/attention.py). At most 16 blocks
    bound the program size.
    """
    block = setting
    if setting == AUTO:
        block = max(32, length // 16) if jax.default_backend() == "cpu" else 0
    if block <= 0 or block >= length or length % block:
        return 0
    return block


def grouped_attention(
    q_BLHd,
    k_BSKd,
    v_BSKd,
    mask=None,
    bias_bHLS=None,
    scale=None,
    causal_block=0,
    keep_BH1S=None,
    sinks_H=None,
):
    """softmax(q k^T * scale + bias, masked) v with K/V shared by groups of H // K heads.

    mask: bool, broadcastable to [B, L, S] (True = may attend). bias: [1 or B, H, L, S].
    keep_BH1S: attention-probability dropout, keep / (1 - rate), applied after the softmax
    and before the value product (T5X: one mask per key, shared by all queries).
    causal_block > 0 (self-attention, L == S, a mask that never lets query i see key j > i):
    queries go in blocks of that size, each against only the keys up to its end, which
    skips the masked half of the work and gives the same result.
    sinks_H: per-head sink logits [H] in the softmax denominator (attention_window.py).
    Returns [B, L, H, d]. Softmax statistics in f32.
    """
    if causal_block:
        return _blocked_causal_attention(
            q_BLHd, k_BSKd, v_BSKd, mask, bias_bHLS, scale, causal_block, keep_BH1S, sinks_H
        )
    b, l, h, d = q_BLHd.shape
    kv_heads = k_BSKd.shape[2]
    groups = h // kv_heads
    q_BLKGd = q_BLHd.reshape(b, l, kv_heads, groups, d)
    logits = jnp.einsum("blkgd,bskd->bkgls", q_BLKGd, k_BSKd, preferred_element_type=jnp.float32)
    if scale is not None:
        logits = logits * scale
    if bias_bHLS is not None:
        bias = bias_bHLS.astype(jnp.float32)
        logits = logits + bias.reshape(bias.shape[0], kv_heads, groups, *bias.shape[2:])
    if mask is not None:
        logits = jnp.where(mask[:, None, None, :, :], logits, NEG_INF)
    probs = softmax_with_sinks(logits, grouped_sinks(sinks_H, kv_heads)).astype(v_BSKd.dtype)
    if keep_BH1S is not None:
        probs = probs * keep_BH1S.reshape(b, kv_heads, groups, 1, -1)
    out = jnp.einsum("bkgls,bskd->blkgd", probs, v_BSKd)
    return out.reshape(b, l, h, d)


def _blocked_causal_attention(
    q_BLHd, k_BSKd, v_BSKd, mask, bias_bHLS, scale, block, keep_BH1S, sinks_H=None
):
    """`grouped_attention` for causal self-attention, one block of queries at a time.

    Block i holds queries [i c, (i + 1) c) and reads keys [0, (i + 1) c). A block's queries
    of one KV head are stacked as G * c rows of one matmul, [B, K, G * c, d] x [B, K, d, S],
    the shape XLA's CPU matmuls run fastest on.
    """
    b, l, h, d = q_BLHd.shape
    kv_heads = k_BSKd.shape[2]
    groups = h // kv_heads
    if l != k_BSKd.shape[1]:
        raise ValueError(
            f"blocked causal attention needs L == S, got q {q_BLHd.shape} k {k_BSKd.shape}"
        )
    if scale is not None:
        # On the queries: one pass over [B, L, H, d] instead of one over every block's logits.
        q_BLHd = q_BLHd * jnp.asarray(scale, q_BLHd.dtype)
    q_BKGLd = q_BLHd.reshape(b, l, kv_heads, groups, d).transpose(0, 2, 3, 1, 4)
    k_BKSd = k_BSKd.transpose(0, 2, 1, 3)
    v_BKSd = v_BSKd.transpose(0, 2, 1, 3)
    positions = jnp.arange(l)
    outs = []
    for start in range(0, l, block):
        end = start + block
        q_BKQd = q_BKGLd[:, :, :, start:end].reshape(b, kv_heads, groups * block, d)
        logits = jnp.einsum(
            "bkqd,bksd->bkqs", q_BKQd, k_BKSd[:, :, :end], preferred_element_type=jnp.float32
        ).reshape(b, kv_heads, groups, block, end)
        if bias_bHLS is not None:
            bias = bias_bHLS[:, :, start:end, :end].astype(jnp.float32)
            logits = logits + bias.reshape(bias.shape[0], kv_heads, groups, block, end)
        allowed = positions[start:end, None] >= positions[None, :end]
        if mask is not None:
            allowed = allowed & mask[:, None, None, start:end, :end]
        logits = jnp.where(allowed, logits, NEG_INF)
        sinks = grouped_sinks(sinks_H, kv_heads)
        probs = softmax_with_sinks(logits, sinks).astype(v_BSKd.dtype)
        if keep_BH1S is not None:
            probs = probs * keep_BH1S[..., :end].reshape(b, kv_heads, groups, 1, end)
        out = jnp.einsum(
            "bkqs,bksd->bkqd",
            probs.reshape(b, kv_heads, groups * block, end),
            v_BKSd[:, :, :end],
        )
        outs.append(out.reshape(b, kv_heads, groups, block, d))
    out_BKGLd = jnp.concatenate(outs, axis=3)
    return out_BKGLd.transpose(0, 3, 1, 2, 4).reshape(b, l, h, d)


QUERY_CHUNK = 256  # queries per rematerialised piece of the dense path


def query_chunked_attention(
    q_BLHd, k_BSKd, v_BSKd, mask=None, bias_bHLS=None, scale=None, keep_BH1S=None, sinks_H=None
):
    """`grouped_attention` (dense path) in pieces of QUERY_CHUNK queries, each rematerialised.

    The same arithmetic per query row. No [B, H, L, S] scores are kept for the backward
    pass: each piece recomputes its own [B, H, chunk, S] there (the dense path on TPU/GPU
    held 1.25 GiB of f32 scores and probabilities per chip for one 2048-token Mixtral
    sequence); the extra work is the attention's two matmuls once more per layer. The
    pieces run in a loop (`lax.map`), not unrolled: unrolled, the TPU compiler overlapped
    the backward of 7 of Mixtral's 8 pieces, 7 x 64 MiB of f32 scores alive at once.
    """
    b, length, h, d = q_BLHd.shape
    chunk = QUERY_CHUNK if length > QUERY_CHUNK and length % QUERY_CHUNK == 0 else length
    if chunk == length:
        return _dense_rematted(
            q_BLHd, k_BSKd, v_BSKd, mask, bias_bHLS, scale, 0, keep_BH1S, sinks_H
        )
    pieces = length // chunk

    def by_piece(a):  # [..., L, S] -> [pieces, ..., chunk, S]; None / one row: shared
        if a is None or a.shape[-2] == 1:
            return None
        a = a.reshape(*a.shape[:-2], pieces, chunk, a.shape[-1])
        return jnp.moveaxis(a, -3, 0)

    def shared(a):
        return a if a is not None and a.shape[-2] == 1 else None

    def piece(xs):
        q_BCHd, mask_piece, bias_piece = xs
        mask_piece = shared(mask) if mask_piece is None else mask_piece
        bias_piece = shared(bias_bHLS) if bias_piece is None else bias_piece
        # The probability dropout mask is per key, shared by every piece of queries.
        return _dense_rematted(
            q_BCHd, k_BSKd, v_BSKd, mask_piece, bias_piece, scale, 0, keep_BH1S, sinks_H
        )

    q_PBCHd = jnp.moveaxis(q_BLHd.reshape(b, pieces, chunk, h, d), 1, 0)
    out_PBCHd = jax.lax.map(piece, (q_PBCHd, by_piece(mask), by_piece(bias_bHLS)))
    return jnp.moveaxis(out_PBCHd, 0, 1).reshape(b, length, h, d)


def head_max_logits(q_BLHd, k_BSKd, mask, scale=None):
    """max over batch, queries and allowed keys of q.k (* scale) per query head: f32 [H].
    mask: bool broadcastable to [B, L, S]. Queries go QUERY_CHUNK at a time, so at most
    [B, H, chunk, S] logits exist at once."""
    b, length, h, d = q_BLHd.shape
    kv_heads = k_BSKd.shape[2]
    chunk = QUERY_CHUNK if length > QUERY_CHUNK and length % QUERY_CHUNK == 0 else length
    pieces = length // chunk
    mask = jnp.broadcast_to(mask, (mask.shape[0], length, k_BSKd.shape[1]))

    def piece(xs):
        q_BCHd, mask_bCS = xs
        q_BCKGd = q_BCHd.reshape(b, chunk, kv_heads, h // kv_heads, d)
        logits = jnp.einsum(
            "bckgd,bskd->bkgcs", q_BCKGd, k_BSKd, preferred_element_type=jnp.float32
        )
        if scale is not None:
            logits = logits * scale
        logits = jnp.where(mask_bCS[:, None, None], logits, -jnp.inf)
        return jnp.max(logits, axis=(0, 3, 4)).reshape(h)

    q_PBCHd = jnp.moveaxis(q_BLHd.reshape(b, pieces, chunk, h, d), 1, 0)
    mask_PbCS = jnp.moveaxis(mask.reshape(mask.shape[0], pieces, chunk, -1), 1, 0)
    return jnp.max(jax.lax.map(piece, (q_PBCHd, mask_PbCS)), axis=0)


_dense_rematted = jax.checkpoint(grouped_attention, static_argnums=(5, 6))  # scale, block


# Bytes of f32 scores one query piece may hold per sequence: at 65,536 keys and 32 heads a
# piece of 256 queries would hold 2 GiB of scores (and as much of probabilities).
PIECE_SCORE_BYTES = 256 * 2**20


def piece_queries(local: int, heads: int, keys: int) -> int:
    """Queries per rematerialised piece: at most QUERY_CHUNK, within PIECE_SCORE_BYTES of
    scores, dividing the device's `local` queries."""
    most = max(1, min(QUERY_CHUNK, PIECE_SCORE_BYTES // (4 * heads * keys)))
    return max(c for c in range(1, min(most, local) + 1) if local % c == 0)
