"""Multi-token prediction (DeepSeek-V3's MTP modules, `model.mtp_depth` = D).

Module k (1..D) predicts the token k + 1 places ahead of each position. At position i it
reads h^{k-1}_i, the previous depth's normed output (h^0: the main model's final-normed
hidden state, the output layer's input), and the embedding of the token k places ahead,
t_{i+k} (the shared embedding table):

    x_i = W_proj [RMSNorm_e(Emb(t_{i+k})); RMSNorm_h(h^{k-1}_i)]      W_proj: [2D, D]
    h^k = RMSNorm_out(Block_k(x))                                       causal over i
    logits^k_i = h^k_i W_head                                          (the shared head)

Block_k is a decoder block like the main stack's (attention + dense or MoE FFN, as layer
num_layers + k - 1 would be). Training adds (mtp_weight / D) * sum_k NLL_k to the loss
(training/steps.py), NLL_k over the positions whose target t_{i+k+1} exists.

The order [embedding; hidden] and the names map one to one onto a DeepSeek-V3 checkpoint's
`model.layers.{num_layers + k - 1}.{enorm, hnorm, eh_proj, shared_head.norm, <block>}`
(conversions/hf/names_deepseek.py). h^0 is the final-normed hidden state, as DeepSeek's
modeling code hands its MTP layer (`previous_hidden_states` after `model.norm`); deeper
modules read the previous module's normed output, the same representation one depth on.
Speculative decoding (inference/speculative.py) drafts with module 1.
"""

import jax.numpy as jnp
from flax import nnx

from jaxmoe.models.layers import Embed, RMSNorm, cast_weight, fan_in_init, make_param, matmul_2d
from jaxmoe.models.stack import run_block


class MTPModule(nnx.Module):
    """One MTP depth around `block` (a transformer.DecoderBlock). Parameters: embed_norm,
    hidden_norm (RMSNorm [D]), proj [2D, D], block, head_norm (RMSNorm [D])."""

    def __init__(self, cfg, block: nnx.Module, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.embed_norm = RMSNorm(d, eps=cfg.norm_eps, rngs=rngs)
        self.hidden_norm = RMSNorm(d, eps=cfg.norm_eps, rngs=rngs)
        # [embedding; hidden] -> D: sharded like an FFN's down projection.
        self.proj = make_param(rngs, fan_in_init((0,)), (2 * d, d), ("mlp", "embed"))
        self.block = block
        self.head_norm = RMSNorm(d, eps=cfg.norm_eps, rngs=rngs)

    def __call__(self, h_BLD, embedded_BLD, **block_kwargs):
        """(h^k [B, L, D], the block's aux, its cache or None) from h^{k-1} and the
        embeddings of the tokens k ahead; `block_kwargs` go to the block (mask, positions,
        train, slot, token_mask_BL, max_logits)."""
        both = jnp.concatenate(
            [self.embed_norm(embedded_BLD), self.hidden_norm(h_BLD.astype(embedded_BLD.dtype))],
            axis=-1,
        )
        x_BLD = matmul_2d(both, cast_weight(self.proj[...], both.dtype))
        x_BLD, aux, cache = self.block(x_BLD, **block_kwargs)
        return self.head_norm(x_BLD), aux, cache


def shifted(x_BL, k: int, fill=0):
    """x moved k places left along the length, `fill` in the last k places: position i holds
    what position i + k held."""
    if k == 0:
        return x_BL
    pad = jnp.full((x_BL.shape[0], k, *x_BL.shape[2:]), fill, x_BL.dtype)
    return jnp.concatenate([x_BL[:, k:], pad], axis=1)


def mtp_key(k: int) -> str:
    """The aux key of MTP module k (0-based): its MoE statistics and attention maxima."""
    return f"mtp_{k}"


def ahead_in_document(x_BL, depth: int, segment_ids_BL=None, fill=0):
    """`shifted(x, depth)`, and `fill` where the position `depth` ahead lies in another
    document of a packed row (segment ids) than the position itself."""
    out = shifted(x_BL, depth, fill)
    if segment_ids_BL is None:
        return out
    same = shifted(segment_ids_BL, depth) == segment_ids_BL
    return jnp.where(same, out, jnp.asarray(fill, out.dtype))


def run_mtp(
    modules,
    embed: Embed,
    h0_BLD,
    tokens_BL,
    *,
    dtype,
    remat,
    token_mask_BL=None,
    segment_ids_BL=None,
    layout=None,
    block_segment_ids_BL=None,
    **kw,
):
    """Training / evaluation: every module over the whole sequence, each rematted like the
    main stack's blocks (`remat`). Returns ([h^1 .. h^D], aux {mtp_key(k): block aux}).
    `token_mask_BL` (the main model's real positions) is shifted with the tokens, so a
    module's MoE statistics count the positions it predicts (in packed rows, those whose
    token ahead is in the same document); `kw` go to the blocks (mask, positions...).
    `layout` (context_parallel.ContextLayout, mesh.context > 1): each module's inputs are
    put in the split layout the blocks' mask describes, its output back in sequence order
    (`block_segment_ids_BL`: the segments the blocks see, None in that layout)."""
    split = layout.split if layout is not None else (lambda a: a)
    merge = layout.merge if layout is not None else (lambda a: a)

    def apply(module, xs, state, row):
        h_BLD, embedded_BLD, mask_BL = xs
        return module(
            h_BLD,
            embedded_BLD,
            token_mask_BL=mask_BL,
            segment_ids_BL=block_segment_ids_BL,
            **kw,
        )

    states, aux = [], {}
    h_BLD = h0_BLD
    for k, module in enumerate(modules):
        depth = k + 1
        embedded_BLD = embed(shifted(tokens_BL, depth), dtype)
        mask_BL = token_mask_BL
        if mask_BL is not None:
            mask_BL = ahead_in_document(mask_BL, depth, segment_ids_BL, False)
        inputs = (split(h_BLD), split(embedded_BLD), split(mask_BL))
        h_BLD, layer_aux, _ = run_block(module, inputs, apply, remat)
        h_BLD = merge(h_BLD)
        states.append(h_BLD)
        if layer_aux:
            aux[mtp_key(k)] = layer_aux
    return states, aux
