"""Per-layer attention kinds (sliding window or full) and learned attention sinks.

`model.sliding_window` = W > 0 gives the layers of kind `sliding` a causal window: query at
position q sees keys k with q - W < k <= q (W keys, itself included), Hugging Face's
`sliding_attention` (Mistral, Gemma, GPT-OSS). `model.layer_types` says which layers:
a comma list of `sliding` / `full` (HF's `sliding_attention` / `full_attention` spellings
too) for every layer, or a shorter list that repeats down the stack ("sliding,full" is
GPT-OSS's alternation at any depth); empty means every layer is `sliding` when W > 0.

`model.attention_sinks`: each head h has a learned logit s_h that joins its softmax
denominator but has no value: p_j = exp(l_j) / (sum_i exp(l_i) + exp(s_h)), so a head can
put weight "nowhere" (GPT-OSS). The sink is not scaled by 1/sqrt(d).
"""

import jax
import jax.numpy as jnp

SLIDING, FULL = "sliding", "full"
_KIND_NAMES = {
    "sliding": SLIDING,
    "sliding_attention": SLIDING,
    "full": FULL,
    "full_attention": FULL,
}


def parse_layer_types(spec: str, num_layers: int, window: int) -> tuple[str, ...]:
    """One kind per layer from `model.layer_types` (see the module doc); ValueError naming
    the key for an unknown kind or a list longer than the model."""
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if not parts:
        return (SLIDING if window > 0 else FULL,) * num_layers
    unknown = [p for p in parts if p not in _KIND_NAMES]
    if unknown:
        raise ValueError(
            f"model.layer_types={spec!r}: unknown kind {unknown[0]!r} "
            "(sliding | full, or sliding_attention | full_attention)"
        )
    if len(parts) > num_layers:
        raise ValueError(
            f"model.layer_types={spec!r} lists {len(parts)} layers, model.num_layers={num_layers}"
        )
    if num_layers % len(parts):
        raise ValueError(
            f"model.layer_types={spec!r}: a pattern of {len(parts)} must divide "
            f"model.num_layers={num_layers} (or list every layer)"
        )
    kinds = tuple(_KIND_NAMES[p] for p in parts)
    return kinds * (num_layers // len(kinds))


def layer_window(cfg, layer_index: int) -> int:
    """The attention window of decoder layer `layer_index`: W for a sliding layer, else 0."""
    window = cfg.sliding_window
    if window <= 0:
        return 0
    kinds = parse_layer_types(cfg.layer_types, cfg.num_layers, window)
    return window if kinds[layer_index] == SLIDING else 0


def window_allowed(query_pos, key_pos, window: int):
    """bool [..., L, S]: keys within the causal window of their query (q - W < k <= q) for
    query positions [..., L] and key positions [..., S]; window 0: plain causal."""
    delta = query_pos[..., :, None] - key_pos[..., None, :]
    allowed = delta >= 0
    if window:
        allowed = allowed & (delta < window)
    return allowed


def with_window(mask_BLS, length: int, window: int):
    """The causal self-attention mask of `length` tokens narrowed to the window."""
    positions = jnp.arange(length)
    band_1LS = window_allowed(positions, positions, window)[None]
    return band_1LS if mask_BLS is None else mask_BLS & band_1LS


def softmax_with_sinks(logits, sinks):
    """softmax over the last axis with one extra logit `sinks` (broadcastable to
    logits[..., :1]) in the denominator, whose probability is dropped; f32.
    sinks None: the plain softmax."""
    if sinks is None:
        return jax.nn.softmax(logits, axis=-1)
    sinks = jnp.broadcast_to(sinks.astype(jnp.float32), (*logits.shape[:-1], 1))
    top = jax.lax.stop_gradient(jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sinks))
    exp = jnp.exp(logits - top)
    return exp / (jnp.sum(exp, axis=-1, keepdims=True) + jnp.exp(sinks - top))


def grouped_sinks(sinks_H, kv_heads: int):
    """Per-head sinks [H] as [K, G, 1, 1], to broadcast against grouped logits [.., K, G, L, S]."""
    if sinks_H is None:
        return None
    return sinks_H.reshape(kv_heads, -1, 1, 1)
