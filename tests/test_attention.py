"""Grouped attention against a naive numpy loop that repeats K/V heads per query head."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.models.attention import Attention, apply_rope, grouped_attention, rope_tables


def naive_attention(q, k, v, mask, scale):
    """q [B,L,H,d], k/v [B,S,K,d]: per head, per query position, explicit softmax."""
    b, l, h, _ = q.shape
    kv_heads = k.shape[2]
    group = h // kv_heads
    out = np.zeros_like(q, dtype=np.float64)
    for bi in range(b):
        for hi in range(h):
            kh = hi // group  # contiguous groups
            for i in range(l):
                logits = np.array([q[bi, i, hi] @ k[bi, j, kh] * scale for j in range(k.shape[1])])
                logits = np.where(mask[i], logits, -np.inf)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[bi, i, hi] = p @ v[bi, :, kh]
    return out


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_grouped_attention_matches_naive(kv_heads):
    rng = np.random.default_rng(0)
    b, l, h, d = 2, 5, 4, 8
    q = rng.normal(size=(b, l, h, d)).astype(np.float32)
    k = rng.normal(size=(b, l, kv_heads, d)).astype(np.float32)
    v = rng.normal(size=(b, l, kv_heads, d)).astype(np.float32)
    mask = np.tril(np.ones((l, l), bool))
    got = grouped_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=jnp.asarray(mask)[None], scale=d**-0.5
    )
    want = naive_attention(q, k, v, mask, d**-0.5)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_rope_matches_complex_rotation():
    """Rotate-half RoPE = multiplying (x_i + i x_{i+d/2}) by exp(i pos theta_i)."""
    rng = np.random.default_rng(1)
    d = 8
    x = rng.normal(size=(1, 3, 2, d)).astype(np.float32)
    pos = np.array([[0, 1, 7]])
    cos, sin = rope_tables(jnp.asarray(pos), d, 10000.0)
    got = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    inv = 1.0 / 10000.0 ** (np.arange(0, d, 2) / d)
    z = (x[..., : d // 2] + 1j * x[..., d // 2 :]) * np.exp(1j * pos[..., None, None] * inv)
    np.testing.assert_allclose(got, np.concatenate([z.real, z.imag], -1), atol=1e-5)


def test_attention_module_equals_mha_with_repeated_kv():
    """A GQA module equals an MHA module whose K/V heads are copies within each group."""
    d_model, h, dh = 16, 4, 8
    gqa = Attention(d_model, h, 2, dh, rope_theta=10000.0, rngs=nnx.Rngs(0))
    mha = Attention(d_model, h, h, dh, rope_theta=10000.0, rngs=nnx.Rngs(1))
    mha.query[...] = gqa.query[...]
    mha.out[...] = gqa.out[...]
    mha.key[...] = jnp.repeat(gqa.key[...], 2, axis=1)
    mha.value[...] = jnp.repeat(gqa.value[...], 2, axis=1)
    x = jax.random.normal(jax.random.key(2), (2, 6, d_model))
    mask = jnp.tril(jnp.ones((6, 6), bool))[None]
    np.testing.assert_allclose(gqa(x, mask=mask), mha(x, mask=mask), atol=1e-5)


def test_bad_head_split_is_one_line_error():
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by num_kv_heads=3"):
        Attention(16, 4, 3, 8, rngs=nnx.Rngs(0))
