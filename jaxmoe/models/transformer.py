"""Decoder-only transformer LM: pre-norm blocks of GQA attention and a dense or MoE FFN."""

import functools
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

from jaxmoe.models.attention import Attention, RopeScaling, same_segment
from jaxmoe.models.attention_window import layer_window
from jaxmoe.models.context_parallel import ContextLayout, context_size
from jaxmoe.models.ffn import build_ffn
from jaxmoe.models.kv_cache import (
    CacheSlot,
    DecodeCache,
    advanced,
    check_matches_stack,
    decoder_mask,
    self_attention,
)
from jaxmoe.models.latent_cache import latent_self_attention
from jaxmoe.models.layers import (
    Embed,
    RMSNorm,
    compute_dtype,
    dropout,
    fan_in_init,
    head_logits,
    make_dropout,
    make_param,
)
from jaxmoe.models.mla import LatentAttention
from jaxmoe.models.moe.replay import row_of, stack_replays
from jaxmoe.models.mtp import MTPModule, run_mtp
from jaxmoe.models.quantization import Quantization
from jaxmoe.models.ring_cache import ring_self_attention
from jaxmoe.models.stack import build_stack, run_stack
from jaxmoe.parallel.sharding import constrain_batch

# A block's aux entry with its attention's largest logit per head, f32 [H], when the call
# asks for it (max_logits=True: MuonClip, training/qk_clip.py).
MAX_LOGIT = "attn_max_logit"


def causal_mask(length: int, segment_ids_BL=None):
    """bool [1 or B, L, L]: causal self-attention, within each document of packed rows."""
    mask = jnp.tril(jnp.ones((length, length), bool))[None]
    if segment_ids_BL is not None:
        mask = mask & same_segment(segment_ids_BL, segment_ids_BL)
    return mask


class DecoderBlock(nnx.Module):
    def __init__(self, cfg, layer_index: int, *, rngs: nnx.Rngs, lora=None):
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.attn: Attention | LatentAttention
        if cfg.attention == "mla":  # DeepSeek's latent attention (latent_cache.py decodes)
            self.attn = LatentAttention(cfg, rngs=rngs)
        else:
            self.attn = Attention(
                cfg.d_model,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                rope_theta=cfg.rope_theta,
                rope_scaling=RopeScaling.from_config(cfg),
                qkv_bias=cfg.qkv_bias,
                causal_block=cfg.attention_block,
                qk_norm=cfg.qk_norm,
                norm_eps=cfg.norm_eps,
                dropout_rate=cfg.dropout_rate,
                window=layer_window(cfg, layer_index),
                sinks=cfg.attention_sinks,
                out_bias=cfg.out_bias,
                kernel=cfg.attention_kernel,
                causal=True,  # DecoderLM's self-attention mask is the causal one
                quant=Quantization.from_config(cfg),
                context_strategy=cfg.context_strategy,
                rngs=rngs,
            )
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.ffn = build_ffn(cfg, layer_index, rngs)
        self.dropout = make_dropout(cfg, rngs)
        if lora is not None:  # before a scanned stack stacks the blocks (models/lora.py)
            from jaxmoe.models.lora import attach_adapters

            attach_adapters(self, lora, rngs, f"layers/{layer_index}")

    def __call__(
        self,
        x_BLD,
        *,
        mask,
        positions_BL,
        train: bool,
        slot=None,
        token_mask_BL=None,
        segment_ids_BL=None,
        max_logits: bool = False,
        replay_BLK=None,
        record_routing: bool = False,
    ):
        """(x, aux, cache). With `slot` (kv_cache.CacheSlot, decoding) the self-attention
        reads and writes the layer's KV cache and `cache` is the updated one (else None).
        `token_mask_BL` (bool, None = all) marks the real tokens for the MoE statistics;
        `segment_ids_BL` the documents of packed rows (`mask` already keeps them apart; a
        fused kernel reads them instead of the mask). `max_logits` (no cache) adds
        aux[MAX_LOGIT], the attention's largest logit per head. `replay_BLK` and
        `record_routing`: an MoE FFN's replayed experts and recorded choices (moe/layer.py)."""
        attn = self.attn
        attend: Callable[..., tuple]
        if isinstance(attn, LatentAttention):
            attend = functools.partial(latent_self_attention, attn)
        elif slot is not None and attn.window:  # a sliding-window layer's cache is a ring
            attend = functools.partial(ring_self_attention, attn)
        else:
            attend = functools.partial(self_attention, attn)
        normed_BLD = self.attn_norm(x_BLD)
        h_BLD, cache = attend(
            normed_BLD,
            mask=mask,
            positions_BL=positions_BL,
            slot=slot,
            train=train,
            segment_ids_BL=segment_ids_BL,
        )
        x_BLD = x_BLD + dropout(self.dropout, h_BLD, train)
        routing = {}
        if replay_BLK is not None:
            routing["replay_BLK"] = replay_BLK
        if record_routing and hasattr(self.ffn, "router"):  # an MoE FFN
            routing["record"] = True
        y_BLD, aux = self.ffn(
            self.ffn_norm(x_BLD), train=train, token_mask_BL=token_mask_BL, **routing
        )
        x_BLD = x_BLD + dropout(self.dropout, y_BLD, train)
        if max_logits and slot is None:
            heads_H = self.attn.max_logits(normed_BLD, mask=mask, positions_BL=positions_BL)
            aux = {**aux, MAX_LOGIT: heads_H}
        return x_BLD, aux, cache


class DecoderLM(nnx.Module):
    """tokens [B, L] -> logits [B, L, V] (f32), plus per-layer MoE aux outputs; with a KV
    cache the same call prefills and decodes."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, lora=None):
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.layers = build_stack(
            cfg,
            lambda i, rngs: DecoderBlock(cfg, i, rngs=rngs, lora=lora),
            cfg.num_layers,
            rngs,
        )
        if lora is not None:
            from jaxmoe.models.lora import check_some_adapted

            check_some_adapted(self.layers, lora)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.dropout = make_dropout(cfg, rngs)  # on the embeddings and the final norm
        if not cfg.tie_embeddings:
            self.lm_head = make_param(
                rngs, fan_in_init((0,)), (cfg.d_model, cfg.vocab_size), ("embed", "vocab")
            )
        if cfg.mtp_depth:  # created last: the main model's init is that of a model without
            self.mtp = nnx.List(
                [
                    MTPModule(cfg, DecoderBlock(cfg, cfg.num_layers + k, rngs=rngs), rngs=rngs)
                    for k in range(cfg.mtp_depth)
                ]
            )

    def __call__(
        self,
        tokens_BL,
        *,
        train: bool = False,
        positions_BL=None,
        token_mask_BL=None,
        cache: DecodeCache | None = None,
        last_only: bool = False,
        head: bool = True,
        segment_ids_BL=None,
        max_logits: bool = False,
        routing_BLMK=None,
        record_routing: bool = False,
    ):
        """Returns (logits_BLV f32, aux) with aux = {layer_index: moe aux dict} in layer order.
        `token_mask_BL` (bool [B, L], None = all real): padding positions, excluded from the
        MoE balance / z losses and routing statistics.

        Packed rows (training and scoring): `segment_ids_BL` int [B, L] numbers the documents
        of each row (0 = padding) and `positions_BL` counts from each document's start; a
        token attends only to the earlier tokens of its own document, in every attention
        kernel, so each document gives the logits it gives alone.

        With `cache` (kv_cache.init_cache) the tokens are the next L of each sequence: they
        attend to the cache and to each other, their keys/values are written at slots
        cache.index.., positions count from each row's first real token (left padding
        cache.pad_B), and the call returns (logits, aux, cache advanced by L): a prefill is
        one call on the prompt, a decode step one call on one token. `last_only`: logits
        of the last position only [B, 1, V] (a prefill needs no more).

        `head=False`: the output layer's input [B, L, D] in place of the logits; the
        chunked loss applies `output_weights` to it a few positions at a time, multi-token
        prediction (`mtp_states`, speculative decoding) reads it as h^0.
        `max_logits`: every layer's aux holds its attention's largest logit per head
        (MAX_LOGIT), for MuonClip.

        Router replay (model.moe.replay): `routing_BLMK` int [B, L, M, K] gives each MoE
        layer's experts per position (moe/replay.py); `record_routing`: each MoE layer's aux
        holds its chosen experts, "experts" [B, L, K] (-1 = unused slot).
        """
        cfg = self.cfg
        b, l = tokens_BL.shape
        layout = None
        if cache is None:
            if positions_BL is None:
                positions_BL = jnp.broadcast_to(jnp.arange(l), (b, l))
            states = None
            if context_size() > 1:  # mesh.context: the load-balanced split layout
                layout = ContextLayout.of(l, context_size())
                tokens_BL, positions_BL = layout.split(tokens_BL), layout.split(positions_BL)
                token_mask_BL = layout.split(token_mask_BL)
                # The layout is the mask: each device builds its own rows, documents included.
                mask = layout.with_segments(segment_ids_BL)
                segment_ids_BL = None
            else:
                mask = causal_mask(l, segment_ids_BL)
            if routing_BLMK is not None and cfg.moe.replay:  # each block's replayed experts
                states = stack_replays(cfg, self.layers, routing_BLMK)
        else:
            check_matches_stack(cache.layers, self.layers, "DecoderLM")
            mask, cache_positions_BL = decoder_mask(cache, l)
            positions_BL = cache_positions_BL if positions_BL is None else positions_BL
            states = cache.layers
        x_BLD = self.embed(tokens_BL, compute_dtype(cfg))
        x_BLD = constrain_batch(dropout(self.dropout, x_BLD, train))

        def apply(layer, x_BLD, layer_state, row):
            slot, replay = None, None
            if cache is not None:
                slot = CacheSlot(layer_state, cache.index, row, cache.pad_B)
            else:  # the state a block is handed without a cache: its replayed experts
                replay = row_of(layer_state, row)
            x_BLD, aux, new_cache = layer(
                x_BLD,
                mask=mask,
                positions_BL=positions_BL,
                train=train,
                slot=slot,
                token_mask_BL=token_mask_BL,
                segment_ids_BL=segment_ids_BL,
                max_logits=max_logits,
                replay_BLK=replay,
                record_routing=record_routing,
            )
            return constrain_batch(x_BLD), aux, new_cache if cache is not None else layer_state

        x_BLD, aux, states = run_stack(
            self.layers, x_BLD, apply, cfg.remat, name=lambda i: i, states=states
        )
        if layout is not None:
            x_BLD = constrain_batch(layout.merge(x_BLD))
        if last_only:
            x_BLD = x_BLD[:, -1:]
        out = self.output_hidden(x_BLD, train) if not head else self.logits(x_BLD, train)
        if cache is None:
            return out, aux
        return out, aux, advanced(cache, states, l)

    def mtp_states(
        self,
        h0_BLD,
        tokens_BL,
        *,
        train=False,
        positions_BL=None,
        token_mask_BL=None,
        segment_ids_BL=None,
        **kw,
    ):
        """Multi-token prediction (models/mtp.py) over whole sequences: ([h^1 .. h^D] [B, L,
        D], aux {"mtp_<k>": ...}) from h^0, the output layer's input (`head=False`), and the
        call's own tokens, positions, real-token mask and segments. `kw`: max_logits. With a
        context axis (mesh.context) the module blocks run in the split layout, as the main
        stack's do; the states come back in sequence order."""
        b, l = tokens_BL.shape
        if positions_BL is None:
            positions_BL = jnp.broadcast_to(jnp.arange(l), (b, l))
        layout, block_segments = None, segment_ids_BL
        if context_size() > 1:
            layout = ContextLayout.of(l, context_size())
            mask = layout.with_segments(segment_ids_BL)  # each device builds its own rows
            positions_BL, block_segments = layout.split(positions_BL), None
        else:
            mask = causal_mask(l, segment_ids_BL)
        return run_mtp(
            self.mtp,
            self.embed,
            h0_BLD,
            tokens_BL,
            dtype=compute_dtype(self.cfg),
            remat=self.cfg.remat,
            token_mask_BL=token_mask_BL,
            segment_ids_BL=segment_ids_BL,
            layout=layout,
            mask=mask,
            positions_BL=positions_BL,
            block_segment_ids_BL=block_segments,
            train=train,
            **kw,
        )

    def mtp_draft_step(self, h_BLD, tokens_BL, cache: DecodeCache):
        """Module 1 on L new positions with its own one-layer cache (speculative decoding):
        h_BLD the main model's head inputs there, tokens_BL the tokens one ahead of them.
        Returns (logits [B, L, V] f32 of the tokens two ahead, cache advanced by L)."""
        mask, positions_BL = decoder_mask(cache, tokens_BL.shape[1])
        embedded_BLD = self.embed(tokens_BL, compute_dtype(self.cfg))
        slot = CacheSlot(cache.layers[0], cache.index, None, cache.pad_B)
        h1_BLD, _, layer_cache = self.mtp[0](
            h_BLD, embedded_BLD, mask=mask, positions_BL=positions_BL, train=False, slot=slot
        )
        logits = head_logits(h1_BLD, *self.output_weights())
        return logits, advanced(cache, [layer_cache], tokens_BL.shape[1])

    def logits(self, x_BLD, train: bool = False):
        """The output layer on the last block's output: logits [B, L, V] f32."""
        return head_logits(self.output_hidden(x_BLD, train), *self.output_weights())

    def output_hidden(self, x_BLD, train: bool = False):
        """The last block's output through the final norm (and dropout): the head's input."""
        return dropout(self.dropout, self.final_norm(x_BLD), train)

    def output_weights(self):
        """(head matrix [D, V] in its parameter dtype, logit scale) for layers.head_logits:
        the embedding table transposed when tied."""
        if self.cfg.tie_embeddings:
            return self.embed.embedding[...].T, 1.0
        return self.lm_head[...], 1.0
