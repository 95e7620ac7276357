"""The latent KV cache of multi-head latent attention (mla.py) and its absorbed decode read.

Per layer and token the cache holds the normed latent c [r] and the rotated shared key
k_rope [dr], nothing per head: kv_lora_rank + qk_rope_head_dim numbers (576 for
DeepSeek-V3, against 2 x 128 heads x 128 for the same model's expanded keys and values).
It reuses kv_cache.LayerCache (shapes: kv_cache.cache_shapes) with k = rope keys [B, S, dr]
and v = latents [B, S, r] (one row per sequence, N = B), so the cache plumbing (stacking
for scanned layers, the masks, beam reordering, sharding of the N axis over the batch) is
the GQA cache's.

Decoding never expands keys or values. Head h's logit against slot s is
q_nope[h] . (c_s W_kup[:, h]) + q_rope[h] . k_rope_s = (q_nope[h] W_kup[:, h]^T) . c_s + ...,
so the query is multiplied into the key up-projection once per new token (q_lat [H, r]),
and likewise the value up-projection is applied after the probabilities have summed the
latents: out[h] = (sum_s p_hs c_s) W_vup[:, h]. Per step that reads the cache once, in
O(S (r + dr)) per head instead of O(S H (dn + dr + dv)) to rebuild the keys and values.
"""

import jax
import jax.numpy as jnp

from jaxmoe.models.attention import NEG_INF
from jaxmoe.models.kv_cache import CacheSlot, LayerCache, layer_view, write_in_place
from jaxmoe.models.mla import LatentAttention


def cache_bytes_per_token(model_cfg) -> int:
    """Bytes of decode cache one token adds, summed over the layers."""
    if model_cfg.attention == "mla":
        per_layer = model_cfg.kv_lora_rank + model_cfg.qk_rope_head_dim
    else:
        per_layer = 2 * model_cfg.num_kv_heads * model_cfg.head_dim
    return per_layer * model_cfg.num_layers * jnp.dtype(model_cfg.dtype).itemsize


def absorbed_attention(attn: LatentAttention, q_nope, q_rope, latent_BSr, rope_key_BSd, mask):
    """Attention of new queries over cached latents with the absorbed projections.

    q_nope [B, L, H, dn], q_rope [B, L, H, dr]; mask bool [B or 1, L, S]. Returns the heads'
    outputs [B, L, H, dv] (before the output projection). Softmax statistics in f32.
    """
    dtype = q_nope.dtype
    q_lat = jnp.einsum("blhn,rhn->blhr", q_nope, attn.key_up(dtype))
    logits = jnp.einsum(
        "blhr,bsr->bhls", q_lat, latent_BSr.astype(dtype), preferred_element_type=jnp.float32
    )
    logits = logits + jnp.einsum(
        "blhd,bsd->bhls", q_rope, rope_key_BSd.astype(dtype), preferred_element_type=jnp.float32
    )
    logits = jnp.where(mask[:, None], logits * attn.scale, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(dtype)
    o_lat = jnp.einsum("bhls,bsr->blhr", probs, latent_BSr.astype(dtype))
    return jnp.einsum("blhr,rhv->blhv", o_lat, attn.value_up(dtype))


def latent_attend_with_cache(attn: LatentAttention, x_BLD, slot: CacheSlot, mask_BLS, positions):
    """L new tokens written at slots index.. of the latent cache and attended over it:
    (output [B, L, D], the updated cache)."""
    q_nope, q_rope = attn.project_q(x_BLD, positions)
    latent, rope_key = attn.project_latent(x_BLD, positions)
    index = jnp.asarray(slot.index, jnp.int32)
    cache = LayerCache(
        write_in_place(slot.cache.k, rope_key, (None, index, None), slot.row),
        write_in_place(slot.cache.v, latent, (None, index, None), slot.row),
    )
    mine = layer_view(cache, slot.row)
    o = absorbed_attention(attn, q_nope, q_rope, mine.v, mine.k, mask_BLS)
    return attn.project_out(o), cache


def latent_self_attention(
    attn: LatentAttention,
    x_BLD,
    *,
    mask,
    positions_BL=None,
    slot=None,
    train=False,
    segment_ids_BL=None,
):
    """kv_cache.self_attention for MLA: (output, updated cache or None). `segment_ids_BL`
    (packed rows) keeps documents apart in a fused kernel's causal mode, which reads no
    mask; the XLA path's `mask` does already."""
    del train  # MLA has no attention dropout
    if slot is None:
        return attn(
            x_BLD, mask=mask, positions_BL=positions_BL, segment_ids_BL=segment_ids_BL
        ), None
    return latent_attend_with_cache(attn, x_BLD, slot, mask, positions_BL)
