"""Dropout at T5X's places inside the blocks: on the attention probabilities (after the
softmax, before the value product; one mask per key shared by every query), on the hidden
units of a dense FFN (after the activation, before wo; one mask per sequence shared along
it: Flaxformer MlpBlock's intermediate_dropout) and of each expert (one mask per expert and
step shared by all its tokens: Flaxformer vmaps MlpBlock over the experts).

References: numpy re-computations of each layer with the test's own mask applied at that
place (the layer's dropout module replaced by a stand-in that multiplies by it), written
from the definitions above, not from jaxmoe's code. Eval and cached decoding are checked
to be unaffected by the rate, and rate 0 to add no RNG state.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.models import build_model
from jaxmoe.models.attention import Attention
from jaxmoe.models.kv_cache import init_cache
from jaxmoe.models.layers import MLP, GatedMLP
from jaxmoe.models.moe.layer import MoE
from jaxmoe.models.spec import model_params, model_rngs
from tests.helpers import tiny_config

RATE = 0.5


class FixedKeep:
    """Stand-in for an nnx.Dropout: multiplies by the test's keep / (1 - rate) array."""

    def __init__(self, keep):
        self.keep = keep

    def __call__(self, x, *, deterministic):
        assert not deterministic
        return x * jnp.asarray(self.keep, x.dtype)


def keep_mask(rng, shape):
    return (rng.random(shape) >= RATE).astype(np.float32) / (1 - RATE)


def softmax(a, axis=-1):
    a = a - a.max(axis=axis, keepdims=True)
    e = np.exp(a)
    return e / e.sum(axis=axis, keepdims=True)


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def silu(x):
    return x / (1 + np.exp(-x))


def attention_reference(x, kv, wq, wk, wv, wo, mask_LS, keep_BH1S):
    """Multi-head attention with H // K query heads per KV head, loops over heads."""
    b, l, _ = x.shape
    h, groups = wq.shape[1], wq.shape[1] // wk.shape[1]
    scale = wq.shape[2] ** -0.5
    out = np.zeros((b, l, wo.shape[-1]))
    for head in range(h):
        kv_head = head // groups
        q = x @ wq[:, head]  # [B, L, d]
        k, v = kv @ wk[:, kv_head], kv @ wv[:, kv_head]  # [B, S, d]
        logits = np.einsum("bld,bsd->bls", q, k) * scale
        probs = softmax(np.where(mask_LS[None], logits, -1e30))
        probs = probs * keep_BH1S[:, head]  # [B, 1, S]: the same key mask for every query
        out += np.einsum("bls,bsd->bld", probs, v) @ wo[head]
    return out


def f64(param):
    return np.asarray(param[...], np.float64)


@pytest.mark.parametrize(
    "path, length, kv_length, causal_block",
    [
        ("dense", 8, 8, 0),
        ("blocked causal", 8, 8, 4),
        ("query chunks", 512, 512, 0),
        ("cross", 6, 10, 0),
    ],
)
def test_attention_probabilities_are_dropped_after_the_softmax(
    path, length, kv_length, causal_block
):
    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim, d_model, batch = 4, 2, 4, 16, 2
    attn = Attention(
        d_model,
        heads,
        kv_heads,
        head_dim,
        rope_theta=0.0,
        causal_block=causal_block,
        dropout_rate=RATE,
        rngs=nnx.Rngs(params=0, dropout=1),
    )
    keep = keep_mask(rng, (batch, heads, 1, kv_length))
    attn.probs_dropout = FixedKeep(keep)
    x = rng.normal(size=(batch, length, d_model)).astype(np.float32)
    cross = path == "cross"
    kv = rng.normal(size=(batch, kv_length, d_model)).astype(np.float32) if cross else x
    causal = np.tril(np.ones((length, length), bool))
    mask = np.ones((length, kv_length), bool) if cross else causal
    got = attn(
        jnp.asarray(x),
        mask=jnp.asarray(mask)[None],
        kv_BSD=jnp.asarray(kv) if cross else None,
        train=True,
    )
    weights = [f64(p) for p in (attn.query, attn.key, attn.value, attn.out)]
    want = attention_reference(x.astype(np.float64), kv.astype(np.float64), *weights, mask, keep)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)
    # Eval: no mask, whatever the module holds.
    ones = np.ones_like(keep)
    want_eval = attention_reference(
        x.astype(np.float64), kv.astype(np.float64), *weights, mask, ones
    )
    got_eval = attn(
        jnp.asarray(x), mask=jnp.asarray(mask)[None], kv_BSD=jnp.asarray(kv) if cross else None
    )
    np.testing.assert_allclose(np.asarray(got_eval), want_eval, rtol=2e-4, atol=2e-5)


def test_the_probability_mask_is_one_per_key_shared_by_the_queries():
    attn = Attention(8, 2, 1, 4, rope_theta=0.0, dropout_rate=0.25, rngs=nnx.Rngs(0, dropout=3))
    captured = {}
    real = attn.probs_dropout

    class Spy:
        def __call__(self, x, *, deterministic):
            captured["shape"] = x.shape
            out = real(x, deterministic=deterministic)
            captured["values"] = np.asarray(out)
            return out

    attn.probs_dropout = Spy()
    attn(jnp.ones((3, 5, 8)), mask=jnp.tril(jnp.ones((5, 5), bool))[None], train=True)
    assert captured["shape"] == (3, 2, 1, 5)  # [B, H, 1, S]: T5X's dropout_shape[-2] = 1
    assert set(np.unique(captured["values"])) <= {0.0, np.float32(1 / 0.75)}


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_dense_ffn_hidden_units_are_dropped_before_the_output_projection(gated):
    rng = np.random.default_rng(1)
    batch, length, d_model, ffn = 2, 5, 8, 16
    if gated:
        mlp = GatedMLP(d_model, ffn, "gelu", dropout_rate=RATE, rngs=nnx.Rngs(0, dropout=1))
    else:
        mlp = MLP(d_model, ffn, "relu", dropout_rate=RATE, rngs=nnx.Rngs(0, dropout=1))
    keep = keep_mask(rng, (batch, 1, ffn))  # one mask per sequence, shared along it
    mlp.hidden_dropout = FixedKeep(keep)
    x = rng.normal(size=(batch, length, d_model)).astype(np.float32)
    x64 = x.astype(np.float64)
    if gated:
        hidden = gelu_tanh(x64 @ f64(mlp.wi_0)) * (x64 @ f64(mlp.wi_1))
    else:
        hidden = np.maximum(x64 @ f64(mlp.wi), 0.0)
    got, _ = mlp(jnp.asarray(x), train=True)
    np.testing.assert_allclose(np.asarray(got), (hidden * keep) @ f64(mlp.wo), rtol=2e-4, atol=2e-5)
    got_eval, _ = mlp(jnp.asarray(x), train=False)
    np.testing.assert_allclose(np.asarray(got_eval), hidden @ f64(mlp.wo), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_each_expert_drops_its_hidden_units_with_one_mask_for_all_its_tokens(gated):
    config = tiny_config(
        "model.dropout_rate=0.5", "model.moe.num_experts=4", f"model.ffn_gated={gated}"
    )
    layer = MoE.of_model(config.model, rngs=model_rngs(jax.random.key(0)))
    experts, ffn = 4, config.model.moe.ffn_dim
    rng = np.random.default_rng(2)
    keep_E1F = keep_mask(rng, (experts, 1, ffn))
    layer.expert_dropout = FixedKeep(keep_E1F.transpose(0, 2, 1))  # the layer asks for [E, F, 1]
    x = rng.normal(size=(2, 6, config.model.d_model)).astype(np.float32)
    got, _ = layer(jnp.asarray(x), train=True)
    # The routing itself is the gate's business (tested elsewhere); take the layer's.
    _, _, routing = layer.route(jnp.asarray(x), train=True)
    indices, weights, chosen = (np.asarray(a) for a in routing)
    act = silu if config.model.activation == "silu" else gelu_tanh
    tokens = x.reshape(-1, x.shape[-1]).astype(np.float64)
    want = np.zeros_like(tokens)
    for t in range(tokens.shape[0]):  # a loop over tokens and their chosen experts
        for slot in range(indices.shape[1]):
            if not chosen[t, slot]:
                continue
            e = indices[t, slot]
            if gated:
                hidden = act(tokens[t] @ f64(layer.wi_0)[e]) * (tokens[t] @ f64(layer.wi_1)[e])
            else:
                hidden = act(tokens[t] @ f64(layer.wi)[e])
            want[t] += weights[t, slot] * ((hidden * keep_E1F[e, 0]) @ f64(layer.wo)[e])
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, rtol=5e-4, atol=5e-5)


ARCHS = {
    "decoder": (),
    "encoder_decoder": (
        "model.arch=encoder_decoder",
        "model.activation=gelu",
        "model.rope_theta=0.0",
    ),
}


def models(arch, *extra):
    plain = tiny_config(*ARCHS[arch], *extra, "model.moe.every=2")
    dropped = tiny_config(*ARCHS[arch], *extra, "model.moe.every=2", "model.dropout_rate=0.3")
    key = jax.random.key(0)
    return (
        build_model(plain.model, rngs=model_rngs(key)),
        build_model(dropped.model, rngs=model_rngs(key)),
        plain,
    )


def logits_of(model, arch, tokens, **kwargs):
    if arch == "decoder":
        return model(tokens, **kwargs)
    return model(tokens + 1, tokens, **kwargs)  # encoder tokens without padding id 0


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_site_is_on_in_training_and_off_at_eval_and_in_cached_decoding(arch):
    plain, dropped, config = models(arch)
    np.testing.assert_equal(
        jax.tree.map(np.asarray, model_params(plain)[1]),
        jax.tree.map(np.asarray, model_params(dropped)[1]),
    )  # dropout adds no parameter
    assert not nnx.state(plain, nnx.RngState)  # rate 0: no RNG state, the model of before
    sites = {type(m).__name__ for _, m in nnx.iter_graph(dropped) if isinstance(m, nnx.Dropout)}
    assert sites == {"Dropout"}
    attentions = [m for _, m in nnx.iter_graph(dropped) if isinstance(m, Attention)]
    assert attentions and all(isinstance(a.probs_dropout, nnx.Dropout) for a in attentions)
    mlps = [m for _, m in nnx.iter_graph(dropped) if isinstance(m, (MLP, GatedMLP))]
    moes = [m for _, m in nnx.iter_graph(dropped) if isinstance(m, MoE)]
    assert mlps and moes
    assert all(isinstance(m.hidden_dropout, nnx.Dropout) for m in mlps)
    assert all(isinstance(m.expert_dropout, nnx.Dropout) for m in moes)

    tokens = jnp.asarray(np.random.default_rng(3).integers(1, 100, (2, 8)), jnp.int32)
    reference, _ = logits_of(plain, arch, tokens)
    np.testing.assert_array_equal(np.asarray(logits_of(dropped, arch, tokens)[0]), reference)
    trained, _ = logits_of(dropped, arch, tokens, train=True)
    assert np.abs(np.asarray(trained) - np.asarray(reference)).max() > 1e-2
    np.testing.assert_array_equal(
        np.asarray(logits_of(plain, arch, tokens, train=True)[0]), reference
    )  # rate 0: training is the eval forward
    cache_plain = init_cache(config.model, 2, 8)
    cached = logits_of(dropped, arch, tokens, cache=cache_plain)[0]
    np.testing.assert_array_equal(
        np.asarray(cached), np.asarray(logits_of(plain, arch, tokens, cache=cache_plain)[0])
    )


def test_expert_rate_follows_dropout_rate_unless_set():
    from jaxmoe.models.moe.layer import expert_dropout_rate

    m = tiny_config("model.dropout_rate=0.1").model
    assert expert_dropout_rate(m.moe, m.dropout_rate) == 0.1
    m = tiny_config("model.dropout_rate=0.1", "model.moe.expert_dropout_rate=0.4").model
    assert expert_dropout_rate(m.moe, m.dropout_rate) == 0.4
    layer = MoE.of_model(
        tiny_config("model.moe.expert_dropout_rate=0.0").model, rngs=model_rngs(jax.random.key(0))
    )
    assert layer.expert_dropout is None
