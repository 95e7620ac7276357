"""Encoder-decoder transformer matching T5.1.1 (the models the GQA paper uptrains).

T5.1.1: pre-norm RMSNorm without bias, relative position bias (one table per stack shared by
its layers, bidirectional buckets in the encoder, causal in the decoder), gated-GELU FFN,
no 1/sqrt(d) scaling of attention logits, a shared input embedding and an untied output
layer. Decoder self- and cross-attention take `num_kv_heads` (MHA / GQA / MQA); the encoder
takes `encoder_num_kv_heads` (0 = MHA, as in the paper). Any FFN slot may be an MoE layer.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.models.attention import AUTO, Attention
from jaxmoe.models.ffn import build_ffn
from jaxmoe.models.kv_cache import cross_attention, self_attention
from jaxmoe.models.layers import (
    Embed,
    RMSNorm,
    compute_dtype,
    dropout,
    fan_in_init,
    make_dropout,
    make_param,
    matmul_2d,
    normal_init,
)
from jaxmoe.models.stack import build_stack, run_stack
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
        rngs=rngs,
    )


class EncoderBlock(nnx.Module):
    def __init__(self, cfg, layer_index, *, rngs):
        kv_heads = cfg.get("encoder_num_kv_heads", 0) or cfg.num_heads
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.attn = _attention(cfg, kv_heads, rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.ffn = build_ffn(cfg, layer_index, rngs)
        self.dropout = make_dropout(cfg, rngs)

    def __call__(self, x, *, mask, bias, train):
        x = x + dropout(self.dropout, self.attn(self.attn_norm(x), mask=mask, bias=bias), train)
        y, aux = self.ffn(self.ffn_norm(x), train=train)
        return x + dropout(self.dropout, y, train), aux


class DecoderBlock(nnx.Module):
    def __init__(self, cfg, layer_index, *, rngs):
        self.self_attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.self_attn = _attention(
            cfg, cfg.num_kv_heads, rngs, causal_block=cfg.get("attention_block", AUTO)
        )
        self.cross_attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.cross_attn = _attention(cfg, cfg.num_kv_heads, rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.ffn = build_ffn(cfg, layer_index, rngs)
        self.dropout = make_dropout(cfg, rngs)

    def __call__(self, x, encoded, *, self_mask, cross_mask, bias, train, slot=None, cross_kv=None):
        """(x, aux). Decoding passes `slot` (kv_cache.CacheSlot: aux["cache"] is the updated
        self-attention cache) and `cross_kv` (the encoder's projected K/V) for `encoded`."""
        h, cache = self_attention(
            self.self_attn, self.self_attn_norm(x), mask=self_mask, bias=bias, slot=slot
        )
        x = x + dropout(self.dropout, h, train)
        h = cross_attention(
            self.cross_attn, self.cross_attn_norm(x), encoded, mask=cross_mask, cross_kv=cross_kv
        )
        x = x + dropout(self.dropout, h, train)
        y, aux = self.ffn(self.ffn_norm(x), train=train)
        x = x + dropout(self.dropout, y, train)
        return x, aux if cache is None else {**aux, "cache": cache}


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
        self.lm_head = make_param(
            rngs, fan_in_init((0,)), (cfg.d_model, cfg.vocab_size), ("embed", "vocab")
        )
        # T5X's places: embeddings, final norms (the encoder's without a shared mask).
        self.dropout = make_dropout(cfg, rngs)
        self.encoder_out_dropout = make_dropout(cfg, rngs, share_along_length=False)

    def encode(self, encoder_tokens_BS, *, train: bool = False):
        """(encoded [B, S, D], aux) for the encoder input tokens."""
        s = encoder_tokens_BS.shape[1]
        valid_BS = encoder_tokens_BS != 0
        mask = valid_BS[:, None, :] & valid_BS[:, :, None]
        bias = self.encoder_relpos(s, s)
        x = self.token_embed(encoder_tokens_BS, compute_dtype(self.cfg))
        x = constrain_batch(dropout(self.dropout, x, train))

        def apply(layer, x):
            x, aux = layer(x, mask=mask, bias=bias, train=train)
            return constrain_batch(x), aux

        x, aux = run_stack(self.encoder_layers, x, apply, self.cfg.remat, lambda i: f"encoder_{i}")
        return dropout(self.encoder_out_dropout, self.encoder_norm(x), train), aux

    def decode(self, decoder_tokens_BL, encoded_BSD, encoder_valid_BS, *, train: bool = False):
        """(logits [B, L, V] f32, aux) given the encoder output."""
        l = decoder_tokens_BL.shape[1]
        self_mask = jnp.tril(jnp.ones((l, l), bool))[None]
        cross_mask = jnp.broadcast_to(
            encoder_valid_BS[:, None, :], (encoder_valid_BS.shape[0], l, encoded_BSD.shape[1])
        )
        bias = self.decoder_relpos(l, l)
        x = self.token_embed(decoder_tokens_BL, compute_dtype(self.cfg))
        x = constrain_batch(dropout(self.dropout, x, train))

        def apply(layer, x):
            x, aux = layer(
                x, encoded_BSD, self_mask=self_mask, cross_mask=cross_mask, bias=bias, train=train
            )
            return constrain_batch(x), aux

        x, aux = run_stack(self.decoder_layers, x, apply, self.cfg.remat, lambda i: f"decoder_{i}")
        return self.decoder_logits(x, train), aux

    def decoder_logits(self, x, train: bool = False):
        """The output layer on the last decoder block's output: logits [B, L, V] f32."""
        x = dropout(self.dropout, self.decoder_norm(x), train)
        return matmul_2d(x, self.lm_head[...].astype(x.dtype)).astype(jnp.float32)

    def __call__(self, encoder_tokens_BS, decoder_tokens_BL, *, train: bool = False):
        encoded, enc_aux = self.encode(encoder_tokens_BS, train=train)
        logits, dec_aux = self.decode(
            decoder_tokens_BL, encoded, encoder_tokens_BS != 0, train=train
        )
        return logits, enc_aux | dec_aux
