"""QK-clip (MuonClip, Kimi K2, `optimizer.qk_clip` = tau): after each optimizer step, a head
whose largest attention logit S_h of the step exceeded tau gets its query and key weights
scaled so that the same inputs would give at most tau: gamma_h = tau / S_h (1 when
S_h <= tau), the logits of head h scale by gamma_h exactly.

- GQA / MHA (query [D, H, d], key [D, K, d]): KV head k, shared by the query heads of its
  group, is scaled by sqrt(min gamma over the group) and each query head by gamma_h over
  that; MHA is sqrt(gamma_h) on both sides, as Kimi K2 splits it. Query/key biases scale
  with their weights (the logit is linear in the projection, rotary included).
- MLA (Kimi K2's own rule): the per-head plain query and key dims (q_up or query [.., H,
  dn + dr], the key half of kv_up [.., H, dn + dv]) by sqrt(gamma_h), the head's rotary
  query dims by gamma_h, the shared rotary key (kv_down) never.

The step's S_h come from the forward pass (models/transformer.py MAX_LOGIT, one [H] per
attention layer, the max over the global batch); the optimizer state is not touched.
QK-norm would undo any rescaling of the projections, so config validation refuses it here.
"""

import jax.numpy as jnp

from jaxmoe.models.mtp import mtp_key
from jaxmoe.models.stack import stack_layout


def attention_sites(model_cfg) -> tuple:
    """((param path of an attention module, its aux key or, stacked, the aux keys of its
    rows), ...) for the decoder's layers, in models/stack.py's layouts, then the MTP
    modules' blocks (models/mtp.py)."""
    mtp = tuple((("mtp", str(k), "block", "attn"), mtp_key(k)) for k in range(model_cfg.mtp_depth))
    return _stack_sites(model_cfg) + mtp


def _stack_sites(model_cfg) -> tuple:
    n = model_cfg.num_layers
    if not model_cfg.scan_layers:
        return tuple((("layers", str(i), "attn"), i) for i in range(n))
    layout = stack_layout(model_cfg)
    h, k, periods = layout.head, layout.period, layout.periods
    sites = [(("layers", "head", str(i), "attn"), i) for i in range(h)]
    if periods:
        sites += [
            (("layers", "period", str(j), "attn"), tuple(h + p * k + j for p in range(periods)))
            for j in range(k)
        ]
    first_tail = h + periods * k
    sites += [(("layers", "tail", str(t), "attn"), first_tail + t) for t in range(layout.tail)]
    return tuple(sites)


def site_keys(sites) -> tuple:
    """Every aux key the sites read, in order (one row per layer of `max_logits_NH`)."""
    keys = []
    for _, key in sites:
        keys += list(key) if isinstance(key, tuple) else [key]
    return tuple(keys)


def clip_factors(max_H, tau: float):
    """gamma = tau / S where S > tau, else 1 (f32, same shape)."""
    max_H = max_H.astype(jnp.float32)
    return jnp.where(max_H > tau, tau / jnp.maximum(max_H, tau), 1.0)


def _scale_gqa(attn: dict, gamma_H) -> dict:
    heads, kv_heads = attn["query"].shape[-2], attn["key"].shape[-2]
    lead = gamma_H.shape[:-1]
    grouped = gamma_H.reshape(*lead, kv_heads, heads // kv_heads)
    key_K = jnp.sqrt(jnp.min(grouped, axis=-1))
    query_H = (grouped / key_K[..., None]).reshape(gamma_H.shape)
    out = dict(attn)
    for name, scale in (("query", query_H), ("key", key_K)):
        out[name] = attn[name] * scale[..., None, :, None].astype(attn[name].dtype)
        if f"{name}_bias" in attn:
            bias = attn[f"{name}_bias"]
            out[f"{name}_bias"] = bias * scale[..., :, None].astype(bias.dtype)
    return out


def _scale_mla(attn: dict, gamma_H, nope: int) -> dict:
    query = "q_up" if "q_up" in attn else "query"
    root_H = jnp.sqrt(gamma_H)[..., None]
    q_width, kv_width = attn[query].shape[-1], attn["kv_up"].shape[-1]
    heads = gamma_H.shape[-1]
    lead = gamma_H.shape[:-1]
    q_cols = jnp.concatenate(
        [
            jnp.broadcast_to(root_H, (*lead, heads, nope)),
            jnp.broadcast_to(gamma_H[..., None], (*lead, heads, q_width - nope)),
        ],
        axis=-1,
    )
    kv_cols = jnp.concatenate(
        [
            jnp.broadcast_to(root_H, (*lead, heads, nope)),
            jnp.ones((*lead, heads, kv_width - nope), gamma_H.dtype),
        ],
        axis=-1,
    )
    out = dict(attn)
    out[query] = attn[query] * q_cols[..., None, :, :].astype(attn[query].dtype)
    out["kv_up"] = attn["kv_up"] * kv_cols[..., None, :, :].astype(attn["kv_up"].dtype)
    return out


def _replace(tree: dict, path: tuple, fn) -> dict:
    if not path:
        return fn(tree)
    return {**tree, path[0]: _replace(tree[path[0]], path[1:], fn)}


def qk_clip(params: dict, max_logits_NH, sites, tau: float, nope: int = 0) -> dict:
    """`params` with every attention module's query/key weights clipped by the step's
    largest logits (`max_logits_NH`, one row per `site_keys(sites)` entry)."""
    row = 0
    for path, key in sites:
        rows = len(key) if isinstance(key, tuple) else None
        take = rows or 1
        gamma = clip_factors(max_logits_NH[row : row + take], tau)
        gamma = gamma if rows else gamma[0]
        row += take

        def scale(attn, gamma=gamma):
            if "kv_up" in attn:
                return _scale_mla(attn, gamma, nope)
            return _scale_gqa(attn, gamma)

        params = _replace(params, path, scale)
    return params
