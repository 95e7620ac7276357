"""Encoder-decoder transformer matching T5.1.1 (the models the GQA paper uptrains).

T5.1.1: pre-norm RMSNorm without bias, relative position bias (one table per stack shared by
its layers, bidirectional buckets in the encoder, causal in the decoder), gated-GELU FFN,
no 1/sqrt(d) scaling of attention logits, a shared input embedding and an untied output
layer. Decoder self- and cross-attention take `num_kv_heads` (MHA / GQA / MQA); the encoder
takes `encoder_num_kv_heads` (0 = MHA, as in the paper). Any FFN slot may be an MoE layer.
With `tie_embeddings` (T5 v1.0, Switch Base) the output layer is the embedding, logits
scaled by 1/sqrt(d_model) as in T5X; with `ffn_gated` False the FFNs are ungated.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.models.attention import Attention, same_segment
from jaxmoe.models.ffn import build_ffn
from jaxmoe.models.kv_cache import (
    CacheSlot,
    DecodeCache,
    advanced,
    cache_length,
    causal_cache_mask,
    check_matches_stack,
    cross_attention,
    layer_view,
    self_attention,
    to_cache_layout,
)
from jaxmoe.models.layers import (
    Embed,
    RMSNorm,
    compute_dtype,
    dropout,
    fan_in_init,
    head_logits,
    make_dropout,
    make_param,
    normal_init,
)
from jaxmoe.models.stack import build_stack, map_stack, run_stack
from jaxmoe.parallel.sharding import constrain_batch


def relative_position_bucket(
    relative_BLS, *, bidirectional: bool, num_buckets: int, max_distance: int
):
    """T5's bucketing of (key position - query position): exact near 0, logarithmic far."""
    n = -relative_BLS
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket = (n < 0).astype(jnp.int32) * num_buckets
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # T5X adds float32 eps inside the log; kept so buckets match its checkpoints exactly.
    scaled = jnp.log(n.astype(jnp.float32) / max_exact + np.finfo(np.float32).eps)
    large = max_exact + (
        scaled / np.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return bucket + jnp.where(is_small, n, large)


class RelativePositionBias(nnx.Module):
    """Per-head scalar bias by relative-position bucket: rel_embedding [H, buckets]."""

    def __init__(self, num_heads, num_buckets, max_distance, *, bidirectional, rngs):
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bidirectional
        self.rel_embedding = make_param(
            rngs, normal_init(1.0), (num_heads, num_buckets), ("heads", "relpos_buckets")
        )

    def __call__(self, query_len: int, key_len: int, query_offset=0):
        """Bias [1, H, L, S] for queries at positions offset..offset+L-1."""
        query_pos = jnp.arange(query_len)[:, None] + query_offset
        key_pos = jnp.arange(key_len)[None, :]
        buckets = relative_position_bucket(
            key_pos - query_pos,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        return jnp.take(self.rel_embedding[...], buckets, axis=1)[None]


def _attention(cfg, kv_heads, rngs, causal_block=0):
    return Attention(
        cfg.d_model,
        cfg.num_heads,
        kv_heads,
        cfg.head_dim,
        rope_theta=0.0,
        scale_logits=False,
        causal_block=causal_block,
        dropout_rate=cfg.dropout_rate,
        # cuDNN's flash attention (`auto` on GPU) where it applies: the cross-attention;
        # the self-attentions add the relative-position bias, which keeps them on XLA.
        kernel=cfg.attention_kernel,
        rngs=rngs,
    )


class EncoderBlock(nnx.Module):
    def __init__(self, cfg, layer_index, *, rngs):
        kv_heads = cfg.encoder_num_kv_heads or cfg.num_heads
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.attn = _attention(cfg, kv_heads, rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.ffn = build_ffn(cfg, layer_index, rngs)
        self.dropout = make_dropout(cfg, rngs)

    def __call__(self, x, *, mask, bias, train, token_mask_BL=None):
        h = self.attn(self.attn_norm(x), mask=mask, bias=bias, train=train)
        x = x + dropout(self.dropout, h, train)
        y, aux = self.ffn(self.ffn_norm(x), train=train, token_mask_BL=token_mask_BL)
        return x + dropout(self.dropout, y, train), aux


class DecoderBlock(nnx.Module):
    def __init__(self, cfg, layer_index, *, rngs):
        self.self_attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.self_attn = _attention(cfg, cfg.num_kv_heads, rngs, causal_block=cfg.attention_block)
        self.cross_attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.cross_attn = _attention(cfg, cfg.num_kv_heads, rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.ffn = build_ffn(cfg, layer_index, rngs)
        self.dropout = make_dropout(cfg, rngs)

    def __call__(
        self,
        x,
        encoded,
        *,
        self_mask,
        cross_mask,
        bias,
        train,
        slot=None,
        cross_kv=None,
        token_mask_BL=None,
    ):
        """(x, aux, cache). Decoding passes `slot` (kv_cache.CacheSlot; `cache` is the
        updated self-attention cache, else None) and `cross_kv` (this layer's projected
        encoder K/V) for `encoded`. `token_mask_BL` (bool, None = all) marks the real
        tokens for the MoE statistics."""
        h, cache = self_attention(
            self.self_attn,
            self.self_attn_norm(x),
            mask=self_mask,
            bias=bias,
            slot=slot,
            train=train,
        )
        x = x + dropout(self.dropout, h, train)
        h = cross_attention(
            self.cross_attn,
            self.cross_attn_norm(x),
            encoded,
            mask=cross_mask,
            cross_kv=cross_kv,
            train=train,
        )
        x = x + dropout(self.dropout, h, train)
        y, aux = self.ffn(self.ffn_norm(x), train=train, token_mask_BL=token_mask_BL)
        x = x + dropout(self.dropout, y, train)
        return x, aux, cache


class EncoderDecoderLM(nnx.Module):
    """(encoder tokens [B, S], decoder input tokens [B, L]) -> logits [B, L, V] f32, aux.

    Token id 0 is padding (T5): encoder padding is masked in both attentions.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.cfg = cfg
        num_encoder_layers = cfg.num_encoder_layers or cfg.num_layers
        self.token_embed = Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.encoder_relpos = RelativePositionBias(
            cfg.num_heads,
            cfg.relpos_buckets,
            cfg.relpos_max_distance,
            bidirectional=True,
            rngs=rngs,
        )
        self.encoder_layers = build_stack(
            cfg, lambda i, rngs: EncoderBlock(cfg, i, rngs=rngs), num_encoder_layers, rngs
        )
        self.encoder_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.decoder_relpos = RelativePositionBias(
            cfg.num_heads,
            cfg.relpos_buckets,
            cfg.relpos_max_distance,
            bidirectional=False,
            rngs=rngs,
        )
        self.decoder_layers = build_stack(
            cfg, lambda i, rngs: DecoderBlock(cfg, i, rngs=rngs), cfg.num_layers, rngs
        )
        self.decoder_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = make_param(
                rngs, fan_in_init((0,)), (cfg.d_model, cfg.vocab_size), ("embed", "vocab")
            )
        # T5X's places: embeddings, final norms (the encoder's without a shared mask).
        self.dropout = make_dropout(cfg, rngs)
        self.encoder_out_dropout = make_dropout(cfg, rngs, share_along_length=False)

    def encode(self, encoder_tokens_BS, *, train: bool = False, segment_ids_BS=None):
        """(encoded [B, S, D], aux) for the encoder input tokens; `segment_ids_BS` (packed
        rows) keeps their documents apart."""
        s = encoder_tokens_BS.shape[1]
        valid_BS = encoder_tokens_BS != 0
        mask = valid_BS[:, None, :] & valid_BS[:, :, None]
        if segment_ids_BS is not None:
            mask = mask & same_segment(segment_ids_BS, segment_ids_BS)
        bias = self.encoder_relpos(s, s)
        x = self.token_embed(encoder_tokens_BS, compute_dtype(self.cfg))
        x = constrain_batch(dropout(self.dropout, x, train))

        def apply(layer, x, state, row):
            x, aux = layer(x, mask=mask, bias=bias, train=train, token_mask_BL=valid_BS)
            return constrain_batch(x), aux, None

        x, aux, _ = run_stack(
            self.encoder_layers, x, apply, self.cfg.remat, lambda i: f"encoder_{i}"
        )
        return dropout(self.encoder_out_dropout, self.encoder_norm(x), train), aux

    def decode(
        self,
        decoder_tokens_BL,
        encoded_BSD,
        encoder_valid_BS,
        *,
        train: bool = False,
        token_mask_BL=None,
        cache: DecodeCache | None = None,
        head: bool = True,
        segment_ids_BL=None,
        encoder_segment_ids_BS=None,
    ):
        """(logits [B, L, V] f32, aux) given the encoder output (`head=False`, training: the
        output layer's input [B, L, D] instead, for the chunked loss); `token_mask_BL` (bool, None =
        all) marks the real decoder positions for the MoE losses and statistics. With `cache`
        (holding the cross-attention K/V, `encoded_BSD` unused) the tokens are the next L at
        slots cache.index.. and the call returns (logits, aux, the advanced cache). Packed
        rows: `segment_ids_BL` and `encoder_segment_ids_BS` number the documents of both
        sides alike; a decoder token sees only its own document's tokens on either side."""
        b, l = decoder_tokens_BL.shape
        if cache is None:
            self_mask = jnp.tril(jnp.ones((l, l), bool))[None]
            if segment_ids_BL is not None:
                self_mask = self_mask & same_segment(segment_ids_BL, segment_ids_BL)
            bias = self.decoder_relpos(l, l)
            states = None
        else:
            check_matches_stack(cache.layers, self.decoder_layers, "EncoderDecoderLM")
            if cache.cross is None:
                raise ValueError("EncoderDecoderLM.decode: the cache holds no cross-attention K/V")
            self_mask = causal_cache_mask(cache, l)
            bias = self.decoder_relpos(l, cache_length(cache.layers[0]), query_offset=cache.index)
            states = list(zip(cache.layers, cache.cross, strict=True))
        cross_mask = jnp.broadcast_to(
            encoder_valid_BS[:, None, :], (b, l, encoder_valid_BS.shape[1])
        )
        if segment_ids_BL is not None:
            cross_mask = cross_mask & same_segment(segment_ids_BL, encoder_segment_ids_BS)
        x = self.token_embed(decoder_tokens_BL, compute_dtype(self.cfg))
        x = constrain_batch(dropout(self.dropout, x, train))

        def apply(layer, x, state, row):
            slot = cross_kv = None
            if state is not None:
                slot = CacheSlot(state[0], cache.index, row)
                cross_kv = layer_view(state[1], row)
            x, aux, layer_cache = layer(
                x,
                encoded_BSD,
                self_mask=self_mask,
                cross_mask=cross_mask,
                bias=bias,
                train=train,
                slot=slot,
                cross_kv=cross_kv,
                token_mask_BL=token_mask_BL,
            )
            return constrain_batch(x), aux, None if state is None else (layer_cache, state[1])

        x, aux, states = run_stack(
            self.decoder_layers, x, apply, self.cfg.remat, lambda i: f"decoder_{i}", states
        )
        if not head and cache is None:
            return self.decoder_hidden(x, train), aux
        logits = self.decoder_logits(x, train)
        if cache is None:
            return logits, aux
        return logits, aux, advanced(cache, [s[0] for s in states], l)

    def cross_kv(self, encoded_BSD) -> list:
        """Every decoder layer's cross-attention K/V of the encoder output, laid out like
        the decoder stack's caches (kv_cache.DecodeCache.cross): projected once per request."""
        return map_stack(
            self.decoder_layers,
            lambda block: to_cache_layout(*block.cross_attn.project_kv(encoded_BSD)),
        )

    def decoder_logits(self, x, train: bool = False):
        """The output layer on the last decoder block's output: logits [B, L, V] f32."""
        return head_logits(self.decoder_hidden(x, train), *self.output_weights())

    def decoder_hidden(self, x, train: bool = False):
        """The last decoder block's output through the final norm (and dropout)."""
        return dropout(self.dropout, self.decoder_norm(x), train)

    def output_weights(self):
        """(head matrix [D, V] in its parameter dtype, logit scale) for layers.head_logits:
        tied, the embedding table transposed and 1/sqrt(d_model) (T5X's scaling)."""
        if self.cfg.tie_embeddings:
            return self.token_embed.embedding[...].T, self.cfg.d_model**-0.5
        return self.lm_head[...], 1.0

    def __call__(
        self,
        encoder_tokens_BS,
        decoder_tokens_BL,
        *,
        train: bool = False,
        token_mask_BL=None,
        cache: DecodeCache | None = None,
        head: bool = True,
        segment_ids_BL=None,
        encoder_segment_ids_BS=None,
    ):
        """Encoder padding (token 0) is known; `token_mask_BL` marks the decoder's real
        positions (e.g. loss weights > 0) for the MoE losses, None = all. Packed rows (T5X's
        `*_segment_ids`): `encoder_segment_ids_BS` / `segment_ids_BL` number the documents
        of each side; relative positions need no per-document positions (T5's bias depends
        only on the distance between two tokens of one document).

        With `cache` (kv_cache.init_cache) the decoder tokens are the next L at slots
        cache.index.. and the call returns (logits, aux, the advanced cache). A cache
        without cross-attention K/V (a new request) runs the encoder on
        `encoder_tokens_BS` and keeps its projected K/V in the returned cache; later calls
        read them and may pass None for the encoder tokens."""
        enc_aux = {}
        if cache is not None and cache.cross is None:
            encoded, enc_aux = self.encode(encoder_tokens_BS, train=train)
            valid_BS = encoder_tokens_BS != 0
            cache = cache._replace(cross=self.cross_kv(encoded), encoder_valid_BS=valid_BS)
        if cache is not None:
            logits, dec_aux, cache = self.decode(
                decoder_tokens_BL,
                None,
                cache.encoder_valid_BS,
                train=train,
                token_mask_BL=token_mask_BL,
                cache=cache,
            )
            return logits, enc_aux | dec_aux, cache
        encoded, enc_aux = self.encode(
            encoder_tokens_BS, train=train, segment_ids_BS=encoder_segment_ids_BS
        )
        logits, dec_aux = self.decode(
            decoder_tokens_BL,
            encoded,
            encoder_tokens_BS != 0,
            train=train,
            token_mask_BL=token_mask_BL,
            head=head,
            segment_ids_BL=segment_ids_BL,
            encoder_segment_ids_BS=encoder_segment_ids_BS,
        )
        return logits, enc_aux | dec_aux
