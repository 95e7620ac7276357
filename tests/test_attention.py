"""Grouped attention against a naive numpy loop that repeats K/V heads per query head."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.models.attention import Attention, apply_rope, grouped_attention, rope_tables


def naive_attention(q, k, v, mask, scale, bias=None):
    """q [B,L,H,d], k/v [B,S,K,d], mask [L,S] or [B,L,S], bias [B,H,L,S]: explicit softmax."""
    b, l, h, _ = q.shape
    kv_heads = k.shape[2]
    group = h // kv_heads
    out = np.zeros_like(q, dtype=np.float64)
    for bi in range(b):
        for hi in range(h):
            kh = hi // group  # contiguous groups
            for i in range(l):
                logits = np.array([q[bi, i, hi] @ k[bi, j, kh] * scale for j in range(k.shape[1])])
                if bias is not None:
                    logits = logits + bias[bi, hi, i]
                row_mask = mask[bi, i] if mask.ndim == 3 else mask[i]
                logits = np.where(row_mask, logits, -np.inf)
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


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_blocked_causal_attention_matches_naive(kv_heads):
    """Query blocks that skip later keys: same outputs with padding and a T5-style bias."""
    rng = np.random.default_rng(3)
    b, l, h, d, block = 2, 12, 4, 8, 4
    q = rng.normal(size=(b, l, h, d)).astype(np.float32)
    k = rng.normal(size=(b, l, kv_heads, d)).astype(np.float32)
    v = rng.normal(size=(b, l, kv_heads, d)).astype(np.float32)
    bias = rng.normal(size=(b, h, l, l)).astype(np.float32)
    valid = np.arange(l)[None, :] < np.array([[l], [7]])  # second row: keys 7.. are padding
    mask = np.tril(np.ones((l, l), bool))[None] & valid[:, None, :]
    args = [jnp.asarray(x) for x in (q, k, v)]
    attend = jax.jit(grouped_attention, static_argnames=("scale", "causal_block"))
    got = attend(
        *args, mask=jnp.asarray(mask), bias_bHLS=jnp.asarray(bias), scale=0.3, causal_block=block
    )
    want = naive_attention(q, k, v, mask, 0.3, bias)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)

    def loss(q, k, v, causal_block):
        out = grouped_attention(
            q, k, v, mask=jnp.asarray(mask), scale=0.3, causal_block=causal_block
        )
        return jnp.sum(out * jnp.sin(jnp.arange(out.size).reshape(out.shape)))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    for blocked, dense in zip(grads(*args, block), grads(*args, 0), strict=True):
        np.testing.assert_allclose(blocked, dense, atol=2e-5)


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "mqa"])
def test_query_chunked_attention_matches_naive(kv_heads, monkeypatch):
    """The dense path in rematerialised pieces of 4 queries: same outputs (padding, bias)
    and the same gradients as one unchunked softmax."""
    from jaxmoe.models import attention

    monkeypatch.setattr(attention, "QUERY_CHUNK", 4)
    rng = np.random.default_rng(5)
    b, l, h, d = 2, 12, 4, 8
    q = rng.normal(size=(b, l, h, d)).astype(np.float32)
    k = rng.normal(size=(b, l, kv_heads, d)).astype(np.float32)
    v = rng.normal(size=(b, l, kv_heads, d)).astype(np.float32)
    bias = rng.normal(size=(1, h, l, l)).astype(np.float32)
    valid = np.arange(l)[None, :] < np.array([[l], [7]])
    mask = np.tril(np.ones((l, l), bool))[None] & valid[:, None, :]
    args = [jnp.asarray(x) for x in (q, k, v)]
    got = attention.query_chunked_attention(*args, jnp.asarray(mask), jnp.asarray(bias), 0.3)
    want = naive_attention(q, k, v, mask, 0.3, np.broadcast_to(bias, (b, h, l, l)))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)

    def loss(fn, q, k, v):
        out = fn(q, k, v, jnp.asarray(mask), jnp.asarray(bias), 0.3)
        return jnp.sum(out * jnp.sin(jnp.arange(out.size).reshape(out.shape)))

    chunked = jax.grad(lambda *a: loss(attention.query_chunked_attention, *a), (0, 1, 2))
    whole = jax.grad(lambda *a: loss(grouped_attention, *a), (0, 1, 2))
    for got, want in zip(chunked(*args), whole(*args), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_query_chunked_attention_shares_a_one_row_mask(monkeypatch):
    """A padding-only mask [B, 1, S] (no bias) is the same for every piece of queries."""
    from jaxmoe.models import attention

    monkeypatch.setattr(attention, "QUERY_CHUNK", 4)
    rng = np.random.default_rng(6)
    b, l, h, d = 2, 8, 2, 4
    q, k, v = (rng.normal(size=(b, l, h, d)).astype(np.float32) for _ in range(3))
    keep = np.arange(l)[None, :] < np.array([[l], [5]])  # [B, S]
    got = attention.query_chunked_attention(
        *(jnp.asarray(x) for x in (q, k, v)), jnp.asarray(keep[:, None, :]), None, 0.5
    )
    want = naive_attention(q, k, v, np.broadcast_to(keep[:, None, :], (b, l, l)), 0.5)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_attention_block_auto_is_cpu_only(monkeypatch):
    from jaxmoe.models import attention_math as attention

    assert attention.resolve_causal_block(attention.AUTO, 256) == 32
    assert attention.resolve_causal_block(attention.AUTO, 2048) == 128
    assert attention.resolve_causal_block(16, 40) == 0  # does not divide: dense
    assert attention.resolve_causal_block(0, 256) == 0
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "tpu")
    assert attention.resolve_causal_block(attention.AUTO, 256) == 0


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
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by num_kv_heads=3") as info:
        Attention(16, 4, 3, 8, rngs=nnx.Rngs(0))
    assert "\n" not in str(info.value)
