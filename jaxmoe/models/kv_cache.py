"""KV caches for autoregressive decoding: their layouts, creation, update and attention read.

There is no forward pass here: `DecoderLM.__call__` and `EncoderDecoderLM.__call__` take a
`DecodeCache` (`cache=`) and run the same embedding, blocks and output layer as training,
with each block's self-attention writing its new keys/values into its cache slot.

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

The caches mirror the layer stack (`stack.stack_modules`): one `LayerCache` per unrolled
block (a scanned stack's head and tail included); its period blocks hold theirs STACKED
[P, ...] along the layer axis (P = number of periods) and carried through the same
`lax.scan` as training, each layer writing and reading its row in place, so the decode
program does not grow with depth.

Decoder-only prompts are left-padded: every row then writes the same cache slot at each
step (one shared index) and keys in the padding are masked out, so a padded row gives the
same logits as its unpadded sequence alone. Rotary positions count from each row's first
real token (`positions = slot - pad`); rotary attention depends only on relative positions,
so this keeps the angles small rather than changing the result.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.models.attention import NEG_INF, Attention
from jaxmoe.models.attention_window import layer_window, softmax_with_sinks
from jaxmoe.models.stack import ScannedStack, stack_layout


class LayerCache(NamedTuple):
    """One attention layer's cache: keys k [N, d, S], values v [N, S, d]; N = B * K rows.
    A scanned period block's cache has a leading layer axis: [P, N, d, S] / [P, N, S, d]."""

    k: jax.Array
    v: jax.Array


class CacheShapes(NamedTuple):
    """The shapes of a LayerCache's k and v."""

    k: tuple[int, ...]
    v: tuple[int, ...]


class DecodeCache(NamedTuple):
    """What a cached model call reads and returns updated.

    layers: self-attention caches, one per stack module (stack.stack_modules order).
    index: int32 [], the slot the first new token is written to (advanced by each call).
    pad_B: int32 [B], left padding per row (decoder-only; zeros for encoder-decoder).
    cross: encoder-decoder only: the encoder output's cross-attention K/V, laid out like
        `layers` (projected once, by the first cached call), and encoder_valid_BS its mask.
    """

    layers: list
    # A field named like tuple.index (the slot index everyone reads as cache.index).
    index: jax.Array  # type: ignore[assignment]
    pad_B: jax.Array
    cross: list | None = None
    encoder_valid_BS: jax.Array | None = None


def cache_shapes(model_cfg, batch: int, length: int) -> CacheShapes:
    """Shapes of one decoder self-attention layer's cache (MLA: latent_cache.py's)."""
    if model_cfg.attention == "mla":  # latent_cache.py: rotary keys and latents, N = B rows
        return CacheShapes(
            k=(batch, length, model_cfg.qk_rope_head_dim),
            v=(batch, length, model_cfg.kv_lora_rank),
        )
    rows, head_dim = batch * model_cfg.num_kv_heads, model_cfg.head_dim
    return CacheShapes(k=(rows, head_dim, length), v=(rows, length, head_dim))


def cache_length(cache: LayerCache) -> int:
    return cache.v.shape[-2]


def longest_cache(caches: list[LayerCache]) -> int:
    """Slots of the full-attention caches: a sliding-window layer's ring (ring_cache.py)
    holds only its window, so the first layer's cache need not be the request's length."""
    return max(cache_length(c) for c in caches)


def stacked_counts(model_cfg) -> list[int | None]:
    """Per stack module of the decoder: its layer count P when scanned, None when a block."""
    if not model_cfg.scan_layers:
        return [None] * model_cfg.num_layers
    return stack_layout(model_cfg).module_counts()


def init_caches(model_cfg, batch: int, length: int, constrain=None) -> list[LayerCache]:
    """Zeroed self-attention caches laid out like the decoder stack (`stacked_counts`).

    `constrain` (LayerCache -> LayerCache, e.g. sharding constraints) places the buffers.
    """
    dtype = jnp.dtype(model_cfg.dtype)
    constrain = constrain or (lambda cache: cache)
    counts = stacked_counts(model_cfg)
    return [
        constrain(
            LayerCache(
                *(jnp.zeros((*lead, *s), dtype) for s in cache_shapes(model_cfg, batch, slots))
            )
        )
        for lead, slots in zip(
            ([] if p is None else [p] for p in counts),
            module_cache_slots(model_cfg, length),
            strict=True,
        )
    ]


def module_cache_slots(model_cfg, length: int) -> list[int]:
    """Cache slots of each stack module: `length`, or a sliding-window layer's ring of
    min(window, length) slots (ring_cache.py), so a long generation does not grow it. A
    scanned module's layers share one kind (gpt_oss_options checks), that of its row 0."""
    if model_cfg.scan_layers:
        layers = stack_layout(model_cfg).module_layers()
    else:
        layers = list(range(model_cfg.num_layers))
    windows = [layer_window(model_cfg, i) for i in layers]
    return [min(w, length) if w else length for w in windows]


def init_cache(model_cfg, batch: int, length: int, pad_B=None, constrain=None) -> DecodeCache:
    """An empty DecodeCache of `length` slots; `pad_B` left padding (None: none)."""
    if pad_B is None:
        pad_B = jnp.zeros((batch,), jnp.int32)
    layers = init_caches(model_cfg, batch, length, constrain)
    return DecodeCache(layers, jnp.zeros((), jnp.int32), jnp.asarray(pad_B, jnp.int32))


def check_matches_stack(caches: list, stack, what: str) -> None:
    """A one-line ValueError when `caches` is not laid out like `stack` (e.g. caches made
    for the unrolled model given to the scanned one)."""
    if isinstance(stack, ScannedStack):
        scanned = [stack.num_periods] * len(stack.period)
        want = [None] * len(stack.head) + scanned + [None] * len(stack.tail)
    else:
        want = [None] * len(stack)
    got = [None if c.k.ndim == 3 else c.k.shape[0] for c in caches]
    if got != want:
        raise ValueError(
            f"{what}: caches laid out as {got} (layer counts per stack module, None = one "
            f"layer), the model's stack as {want}: build them with init_caches(model.cfg, ...)"
        )


def cached_attention(q_BLHd, k_NdS, v_NSd, mask=None, bias_bHLS=None, scale=None, sinks_H=None):
    """`attention.grouped_attention` for the cache layouts; K/V are never repeated.

    mask: bool [B or 1, L, S]. bias: [B or 1, H, L, S]. sinks_H: sink logits [H] or None.
    Returns [B, L, H, d].
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
    sinks = None
    if sinks_H is not None:  # [H] -> [N, G, 1, 1], row b * K + k holding KV head k's group
        sinks = jnp.broadcast_to(sinks_H.reshape(1, kv_heads, groups), (b, kv_heads, groups))
        sinks = sinks.reshape(n, groups, 1, 1)
    probs = softmax_with_sinks(logits, sinks).astype(v_NSd.dtype)
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


class CacheSlot(NamedTuple):
    """What a block's self-attention needs to decode: its cache, the first slot the new
    tokens are written to, and (a stacked cache [P, ...]) the row of this layer, else None."""

    cache: LayerCache
    index: jax.Array  # type: ignore[assignment]  # (as DecodeCache.index)
    row: jax.Array | None = None
    pad_B: jax.Array | None = None  # left padding per row (ring_cache.py's sliding layers)


def layer_view(cache: LayerCache, row) -> LayerCache:
    """The [N, ...] cache of one layer: row `row` of a stacked cache (None: `cache` itself).

    On CPU XLA copies the row out (its dot cannot read a dynamic slice in place): a scanned
    decode step reads each layer's cache about twice more than an unrolled one, 2.2x the
    unrolled per-token time at a 1056-slot cache of 8 KV heads x 4 sequences, 0.64x at 160
    slots x 1 (docs/scan_layers.md). The new keys/values are still written in place.
    """
    if row is None:
        return cache
    return LayerCache(*(jax.lax.dynamic_index_in_dim(x, row, keepdims=False) for x in cache))


def write_in_place(buffer, new, starts, row):
    """`new` written into `buffer` at `starts` (in row `row` of a stacked buffer), in place."""
    zero = jnp.zeros((), jnp.int32)
    starts = tuple(zero if s is None else s for s in starts)
    if row is None:
        return jax.lax.dynamic_update_slice(buffer, new.astype(buffer.dtype), starts)
    return jax.lax.dynamic_update_slice(buffer, new[None].astype(buffer.dtype), (row, *starts))


def attend_with_cache(
    attn: Attention, x_BLD, slot: CacheSlot, mask_BLS, positions_BL=None, bias=None
):
    """Self-attention of L new tokens at cache slots index..index+L-1 over the whole cache.

    Returns (output [B, L, D], the cache with the new keys/values written in place).
    """
    q_BLHd = attn.project_q(x_BLD, positions_BL)
    new = to_cache_layout(*attn.project_kv(x_BLD, positions_BL))
    index = jnp.asarray(slot.index, jnp.int32)
    cache = LayerCache(
        write_in_place(slot.cache.k, new.k, (None, None, index), slot.row),
        write_in_place(slot.cache.v, new.v, (None, index, None), slot.row),
    )
    mine = layer_view(cache, slot.row)
    sinks = attn.sink_logits()
    o_BLHd = cached_attention(q_BLHd, mine.k, mine.v, mask_BLS, bias, attn.scale, sinks)
    return attn.project_out(o_BLHd), cache


def self_attention(
    attn: Attention,
    x_BLD,
    *,
    mask,
    positions_BL=None,
    bias=None,
    slot=None,
    train=False,
    segment_ids_BL=None,
):
    """(output, updated LayerCache or None): plain self-attention (of packed rows with
    `segment_ids_BL`), or with `slot` the new tokens' keys/values written to the cache and
    attended over it. `train`: probability dropout (never with a cache)."""
    if slot is None:
        out = attn(
            x_BLD,
            mask=mask,
            bias=bias,
            positions_BL=positions_BL,
            train=train,
            segment_ids_BL=segment_ids_BL,
        )
        return out, None
    return attend_with_cache(attn, x_BLD, slot, mask, positions_BL, bias)


def cross_attention(attn: Attention, x_BLD, encoded_BSD, *, mask, cross_kv=None, train=False):
    """Cross-attention to the encoder output, or to its keys/values `cross_kv` (one layer's
    LayerCache) projected once for decoding. `train`: probability dropout (never decoding)."""
    if cross_kv is None:
        return attn(x_BLD, mask=mask, kv_BSD=encoded_BSD, train=train)
    o_BLHd = cached_attention(attn.project_q(x_BLD), cross_kv.k, cross_kv.v, mask, scale=attn.scale)
    return attn.project_out(o_BLHd)


def new_slots(cache: DecodeCache, length: int):
    """Cache slots [L] int32 of `length` new tokens."""
    return cache.index + jnp.arange(length, dtype=jnp.int32)


def decoder_mask(cache: DecodeCache, length: int):
    """(mask bool [B, L, S], rotary positions [B, L]) of `length` new decoder-only tokens:
    causal over the cache slots, left padding masked, positions from each row's first token."""
    slots_L = new_slots(cache, length)
    key_slots_S = jnp.arange(longest_cache(cache.layers), dtype=jnp.int32)
    causal_LS = key_slots_S[None, :] <= slots_L[:, None]
    not_padding_BS = key_slots_S[None, :] >= cache.pad_B[:, None]
    positions_BL = jnp.maximum(slots_L[None, :] - cache.pad_B[:, None], 0)
    return causal_LS[None] & not_padding_BS[:, None, :], positions_BL


def causal_cache_mask(cache: DecodeCache, length: int):
    """Causal mask bool [1, L, S] of `length` new tokens over the cache slots."""
    key_slots_S = jnp.arange(cache_length(cache.layers[0]), dtype=jnp.int32)
    return (key_slots_S[None, :] <= new_slots(cache, length)[:, None])[None]


def advanced(cache: DecodeCache, layers: list, length: int, **changes) -> DecodeCache:
    """`cache` with updated layer caches and its index moved past `length` new tokens."""
    return cache._replace(layers=layers, index=cache.index + length, **changes)


def reorder_rows(caches: list[LayerCache], source_B) -> list[LayerCache]:
    """Caches whose sequence b is sequence source_B[b] of `caches` (beam search), for
    per-layer [N, ...] and stacked [P, N, ...] caches alike."""

    def take(x):
        lead = x.shape[: x.ndim - 3]
        rows = source_B.shape[0]
        split = x.reshape(*lead, rows, -1, *x.shape[-2:])
        return jnp.take(split, source_B, axis=len(lead)).reshape(x.shape)

    return [LayerCache(*(take(x) for x in cache)) for cache in caches]
