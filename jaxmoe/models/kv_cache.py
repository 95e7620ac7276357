"""KV caches and the cached forward passes used for autoregressive decoding.

A cache holds, per attention layer, the keys and values of the K KV heads only, so its size
and the bandwidth each decode step spends reading it scale with K, not with the H query
heads. Its layouts are the ones XLA on CPU handled best (measured at 2048+ positions,
d = 64): keys k [N, d, S] and values v [N, S, d] with N = B * K rows (row b * K + k is KV head
k of sequence b).
- Heads before positions: each (sequence, KV head) reads contiguous slabs; with the
  training layout [B, S, K, d] XLA transposed the whole cache every step (3.7x slower).
- Keys transposed: q k^T is a plain [G, d] x [d, S] product for any group size G (with keys
  as [S, d] it ran at 1 GB/s for groups of 2-4 query heads).
- One merged N axis: with separate B and K axes, a batch of one made XLA copy the whole
  cache twice per step around its in-place update (8x slower with 64 KV heads).
Sharding the N axis over the batch mesh axes and then `tensor` splits it exactly as B over
the batch axes and K over `tensor` would (major-to-minor order).
S is fixed per request (prompt bucket + new-token bucket) and new entries are written in
place with `lax.dynamic_update_slice`, so a whole generation runs inside one compiled loop
with static shapes.

Decoder-only prompts are left-padded: every row then writes the same cache slot at each
step (one shared index) and keys in the padding are masked out, so a padded row gives the
same logits as its unpadded sequence alone. Rotary positions count from each row's first
real token (`positions = slot - pad`); rotary attention depends only on relative positions,
so this keeps the angles small rather than changing the result.

The cached forward passes call the models' own blocks, with a `CacheSlot` (the layer's
cache and the slot to write) for self-attention and precomputed cross-attention K/V: the
block code of training is the block code of decoding. tests/test_decode.py checks them
against the full forward pass at every position. The layers are walked one by one (a
scanned stack's rows sliced out), so the decode program still grows with depth.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.models.attention import NEG_INF, Attention
from jaxmoe.models.stack import unrolled_blocks


class LayerCache(NamedTuple):
    """One attention layer's cache: keys k [N, d, S], values v [N, S, d]; N = B * K rows."""

    k: jax.Array
    v: jax.Array


def cache_shapes(model_cfg, batch: int, length: int) -> LayerCache:
    """Shapes of one decoder self-attention layer's cache."""
    rows, head_dim = batch * model_cfg.num_kv_heads, model_cfg.head_dim
    return LayerCache(k=(rows, head_dim, length), v=(rows, length, head_dim))


def cache_length(cache: LayerCache) -> int:
    return cache.v.shape[1]


def init_caches(model_cfg, batch: int, length: int, constrain=None) -> list[LayerCache]:
    """Zeroed self-attention caches for every decoder layer.

    `constrain` (LayerCache -> LayerCache, e.g. sharding constraints) places the buffers.
    """
    shapes = cache_shapes(model_cfg, batch, length)
    dtype = jnp.dtype(model_cfg.dtype)
    constrain = constrain or (lambda cache: cache)
    return [
        constrain(LayerCache(*(jnp.zeros(shape, dtype) for shape in shapes)))
        for _ in range(model_cfg.num_layers)
    ]


def cached_attention(q_BLHd, k_NdS, v_NSd, mask=None, bias_bHLS=None, scale=None):
    """`attention.grouped_attention` for the cache layouts; K/V are never repeated.

    mask: bool [B or 1, L, S]. bias: [B or 1, H, L, S]. Returns [B, L, H, d].
    """
    b, l, h, d = q_BLHd.shape
    n, s = k_NdS.shape[0], k_NdS.shape[2]
    kv_heads = n // b
    groups = h // kv_heads
    q_NGLd = q_BLHd.reshape(b, l, kv_heads, groups, d).transpose(0, 2, 3, 1, 4)
    q_NGLd = q_NGLd.reshape(n, groups, l, d)
    logits = jnp.einsum("ngld,nds->ngls", q_NGLd, k_NdS, preferred_element_type=jnp.float32)
    if scale is not None:
        logits = logits * scale
    if bias_bHLS is not None:
        bias = bias_bHLS.astype(jnp.float32).reshape(-1, kv_heads, groups, l, s)
        bias = jnp.broadcast_to(bias, (b, kv_heads, groups, l, s))
        logits = logits + bias.reshape(n, groups, l, s)
    if mask is not None:
        mask = jnp.broadcast_to(mask.reshape(-1, 1, 1, l, s), (b, kv_heads, 1, l, s))
        logits = jnp.where(mask.reshape(n, 1, l, s), logits, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_NSd.dtype)
    # Materialise the probabilities: XLA on CPU otherwise fuses the softmax into the
    # probs x V product, which then ran 2-5x slower for groups of 2-8 query heads (measured).
    probs = jax.lax.optimization_barrier(probs)
    out_NGLd = jnp.einsum("ngls,nsd->ngld", probs, v_NSd)
    return out_NGLd.reshape(b, kv_heads, groups, l, d).transpose(0, 3, 1, 2, 4).reshape(b, l, h, d)


def to_cache_layout(k_BSKd, v_BSKd) -> LayerCache:
    """Projected keys/values [B, S, K, d] in the cache layouts [N, d, S] / [N, S, d]."""
    b, s, kv_heads, d = k_BSKd.shape
    k_NdS = k_BSKd.transpose(0, 2, 3, 1).reshape(b * kv_heads, d, s)
    v_NSd = v_BSKd.transpose(0, 2, 1, 3).reshape(b * kv_heads, s, d)
    return LayerCache(k_NdS, v_NSd)


def attend_with_cache(
    attn: Attention, x_BLD, cache: LayerCache, index, mask_BLS, positions_BL=None, bias=None
):
    """Self-attention of L new tokens at cache slots index..index+L-1 over the whole cache.

    Returns (output [B, L, D], the cache with the new keys/values written in place).
    """
    q_BLHd = attn.project_q(x_BLD, positions_BL)
    new = to_cache_layout(*attn.project_kv(x_BLD, positions_BL))
    zero, index = jnp.zeros((), jnp.int32), jnp.asarray(index, jnp.int32)
    k_NdS = jax.lax.dynamic_update_slice(cache.k, new.k.astype(cache.k.dtype), (zero, zero, index))
    v_NSd = jax.lax.dynamic_update_slice(cache.v, new.v.astype(cache.v.dtype), (zero, index, zero))
    o_BLHd = cached_attention(q_BLHd, k_NdS, v_NSd, mask_BLS, bias, attn.scale)
    return attn.project_out(o_BLHd), LayerCache(k_NdS, v_NSd)


class CacheSlot(NamedTuple):
    """What a block's self-attention needs to decode: its layer's cache and the first slot
    the new tokens are written to."""

    cache: LayerCache
    index: jax.Array


def self_attention(attn: Attention, x_BLD, *, mask, positions_BL=None, bias=None, slot=None):
    """(output, updated LayerCache or None): plain self-attention, or with `slot` the new
    tokens' keys/values written to the cache and attended over it."""
    if slot is None:
        return attn(x_BLD, mask=mask, bias=bias, positions_BL=positions_BL), None
    return attend_with_cache(attn, x_BLD, slot.cache, slot.index, mask, positions_BL, bias)


def cross_attention(attn: Attention, x_BLD, encoded_BSD, *, mask, cross_kv=None):
    """Cross-attention to the encoder output, or to its keys/values `cross_kv` projected
    once for decoding (encode_for_decoding)."""
    if cross_kv is None:
        return attn(x_BLD, mask=mask, kv_BSD=encoded_BSD)
    o_BLHd = cached_attention(attn.project_q(x_BLD), cross_kv.k, cross_kv.v, mask, scale=attn.scale)
    return attn.project_out(o_BLHd)


def _slots(index, length: int):
    return jnp.asarray(index, jnp.int32) + jnp.arange(length, dtype=jnp.int32)


def decoder_forward(model, tokens_BL, caches: list[LayerCache], index, pad_B, *, last_only=False):
    """`DecoderLM` on L new tokens at slots index.. with left padding `pad_B` per row.

    Returns (logits [B, L or 1, V] f32, updated caches). `last_only` computes the output layer
    for the last position only (prefill needs no more).
    """
    cfg = model.cfg
    l = tokens_BL.shape[1]
    s = cache_length(caches[0])
    slots_L = _slots(index, l)
    positions_BL = jnp.maximum(slots_L[None, :] - pad_B[:, None], 0)
    key_slots_S = jnp.arange(s, dtype=jnp.int32)
    causal_LS = key_slots_S[None, :] <= slots_L[:, None]
    not_padding_BS = key_slots_S[None, :] >= pad_B[:, None]
    mask_BLS = causal_LS[None] & not_padding_BS[:, None, :]
    x_BLD = model.embed(tokens_BL, jnp.dtype(cfg.dtype))
    new_caches = []
    for layer, cache in zip(unrolled_blocks(model.layers), caches, strict=True):
        slot = CacheSlot(cache, jnp.asarray(index, jnp.int32))
        x_BLD, aux = layer(x_BLD, mask=mask_BLS, positions_BL=positions_BL, train=False, slot=slot)
        new_caches.append(aux["cache"])
    if last_only:
        x_BLD = x_BLD[:, -1:]
    return model.logits(x_BLD), new_caches


def encode_for_decoding(model, encoder_tokens_BS):
    """Run the encoder once; return (cross-attention K/V per decoder layer, valid_BS).

    The cross-attention keys and values depend only on the encoder output, so they are
    projected once here and read by every decode step.
    """
    encoded_BSD, _ = model.encode(encoder_tokens_BS, train=False)
    cross = [
        to_cache_layout(*layer.cross_attn.project_kv(encoded_BSD))
        for layer in unrolled_blocks(model.decoder_layers)
    ]
    return cross, encoder_tokens_BS != 0


def encoder_decoder_forward(
    model, tokens_BL, caches: list[LayerCache], cross: list[LayerCache], encoder_valid_BS, index
):
    """`EncoderDecoderLM.decode` on L new decoder tokens at slots index...

    Returns (logits [B, L, V] f32, updated self-attention caches).
    """
    b, l = tokens_BL.shape
    s = cache_length(caches[0])
    slots_L = _slots(index, l)
    key_slots_S = jnp.arange(s, dtype=jnp.int32)
    self_mask_1LS = (key_slots_S[None, :] <= slots_L[:, None])[None]
    cross_mask_BLS = jnp.broadcast_to(
        encoder_valid_BS[:, None, :], (b, l, encoder_valid_BS.shape[1])
    )
    bias_1HLS = model.decoder_relpos(l, s, query_offset=slots_L[0])
    x_BLD = model.token_embed(tokens_BL, jnp.dtype(model.cfg.dtype))
    new_caches = []
    blocks = unrolled_blocks(model.decoder_layers)
    for layer, cache, kv in zip(blocks, caches, cross, strict=True):
        x_BLD, aux = layer(
            x_BLD,
            None,
            self_mask=self_mask_1LS,
            cross_mask=cross_mask_BLS,
            bias=bias_1HLS,
            train=False,
            slot=CacheSlot(cache, jnp.asarray(index, jnp.int32)),
            cross_kv=kv,
        )
        new_caches.append(aux["cache"])
    return model.decoder_logits(x_BLD), new_caches
