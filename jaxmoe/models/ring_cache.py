"""Decoding a sliding-window layer: its cache is a ring of R = min(window, cache length)
slots, so a generation longer than the window never grows it.

Cache slot s (the s-th token of the row, left padding included) lives at ring position
s mod R. Before a call writing slots index..index+L-1, ring position j holds slot
s_j = index - 1 - ((index - 1 - j) mod R), the latest slot before `index` congruent to j
(none when s_j < 0). The L new tokens attend over the ring and their own keys together
([R + L] keys; a prefill longer than the window needs keys the ring cannot hold), masked by
slot: causal, within the window (q - W < s <= q), past the row's left padding. Then the
last min(L, R) new keys/values are written at their ring positions. Layouts are kv_cache's
(keys [N, d, R], values [N, R, d]; stacked [P, ...] in a scanned stack).
"""

import jax
import jax.numpy as jnp

from jaxmoe.models.attention import Attention
from jaxmoe.models.attention_window import window_allowed
from jaxmoe.models.kv_cache import (
    CacheSlot,
    LayerCache,
    cache_length,
    cached_attention,
    layer_view,
    to_cache_layout,
)


def ring_slots(index, ring: int):
    """int32 [R]: the cache slot each ring position holds before a write at `index`
    (negative: empty)."""
    last = jnp.asarray(index, jnp.int32) - 1
    return last - jnp.mod(last - jnp.arange(ring, dtype=jnp.int32), ring)


def _write_ring(buffer, new, positions, axis: int, row):
    """`new` scattered into `buffer` at `positions` along `axis` of one layer's [N, ...]
    (row `row` of a stacked buffer)."""
    index = [slice(None)] * 3
    index[axis] = positions
    layer = buffer if row is None else jax.lax.dynamic_index_in_dim(buffer, row, keepdims=False)
    layer = layer.at[tuple(index)].set(new.astype(buffer.dtype))
    if row is None:
        return layer
    return jax.lax.dynamic_update_index_in_dim(buffer, layer, row, 0)


def attend_with_ring(attn: Attention, x_BLD, slot: CacheSlot, positions_BL=None):
    """(output [B, L, D], the ring cache with the newest keys/values written)."""
    b, length = x_BLD.shape[:2]
    q_BLHd = attn.project_q(x_BLD, positions_BL)
    new = to_cache_layout(*attn.project_kv(x_BLD, positions_BL))
    mine = layer_view(slot.cache, slot.row)
    ring = cache_length(mine)
    index = jnp.asarray(slot.index, jnp.int32)
    query_slots_L = index + jnp.arange(length, dtype=jnp.int32)
    key_slots_S = jnp.concatenate([ring_slots(index, ring), query_slots_L])
    pad_B = jnp.zeros((b,), jnp.int32) if slot.pad_B is None else slot.pad_B
    allowed_LS = window_allowed(query_slots_L, key_slots_S, attn.window)
    valid_BS = key_slots_S[None, :] >= jnp.maximum(pad_B, 0)[:, None]
    mask_BLS = allowed_LS[None] & valid_BS[:, None, :]
    k_NdS = jnp.concatenate([mine.k, new.k.astype(mine.k.dtype)], axis=2)
    v_NSd = jnp.concatenate([mine.v, new.v.astype(mine.v.dtype)], axis=1)
    o_BLHd = cached_attention(
        q_BLHd, k_NdS, v_NSd, mask_BLS, scale=attn.scale, sinks_H=attn.sink_logits()
    )
    kept = min(length, ring)  # older new tokens fall out of the window before any reads them
    positions = jnp.mod(query_slots_L[length - kept :], ring)
    cache = LayerCache(
        _write_ring(slot.cache.k, new.k[:, :, length - kept :], positions, 2, slot.row),
        _write_ring(slot.cache.v, new.v[:, length - kept :], positions, 1, slot.row),
    )
    return attn.project_out(o_BLHd), cache


def ring_self_attention(
    attn: Attention, x_BLD, *, mask, positions_BL=None, slot, train=False, segment_ids_BL=None
):
    """kv_cache.self_attention's signature for a sliding-window layer decoding with `slot`
    (its ring masks itself: `mask`, built for the full-length caches, is not used)."""
    del mask, train, segment_ids_BL  # decoding: no dropout, one sequence per row
    return attend_with_ring(attn, x_BLD, slot, positions_BL)
