"""GPT-OSS's pieces against independent references: numpy loops for the attention sinks,
the sliding-window mask and the clamped SwiGLU; transformers' own YaRN frequencies; the
ring-buffer cache against the full forward of a model with a window shorter than the
generation; expert biases against a numpy loop over tokens and experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.config.defaults import base_config
from jaxmoe.config.validation import validate
from jaxmoe.errors import ConfigError
from jaxmoe.models.attention import grouped_attention
from jaxmoe.models.attention_window import parse_layer_types, window_allowed
from jaxmoe.models.kv_cache import init_cache
from jaxmoe.models.moe.glu import ClampedSwiGLU, gated_hidden
from jaxmoe.models.rope_yarn import yarn_attention_factor, yarn_inv_freq
from jaxmoe.models.transformer import DecoderLM


def numpy_attention(q, k, v, window, sinks, scale):
    """Loop over batch, heads and queries: q [B, L, H, d], k/v [B, L, K, d], sinks [H]."""
    b, length, h, _ = q.shape
    group = h // k.shape[2]
    out = np.zeros_like(q, dtype=np.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(length):
                keys = [j for j in range(length) if j <= i and (not window or i - j < window)]
                logits = np.array([q[bi, i, hi] @ k[bi, j, hi // group] * scale for j in keys])
                top = max(logits.max(), sinks[hi])
                weights = np.exp(logits - top) / (
                    np.exp(logits - top).sum() + np.exp(sinks[hi] - top)
                )
                out[bi, i, hi] = sum(
                    w * v[bi, j, hi // group] for w, j in zip(weights, keys, strict=True)
                )
    return out


@pytest.mark.parametrize(("window", "block"), [(3, 0), (3, 4), (0, 0)])
def test_sinks_and_window_match_numpy(window, block):
    rng = np.random.default_rng(0)
    q, k, v = (
        rng.normal(size=s).astype(np.float32) for s in [(2, 8, 4, 8), (2, 8, 2, 8), (2, 8, 2, 8)]
    )
    sinks = rng.normal(size=4).astype(np.float32) * 2
    positions = jnp.arange(8)
    mask = window_allowed(positions, positions, window)[None]
    got = grouped_attention(q, k, v, mask, None, 8**-0.5, block, None, jnp.asarray(sinks))
    want = numpy_attention(q, k, v, window, sinks, 8**-0.5)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_window_boundary_is_hf_sliding_attention():
    """Query 5 with window 3 sees keys 3, 4, 5 (HF: kv_idx > q_idx - window)."""
    allowed = np.asarray(window_allowed(jnp.arange(8), jnp.arange(8), 3))
    assert np.flatnonzero(allowed[5]).tolist() == [3, 4, 5]
    assert np.flatnonzero(allowed[1]).tolist() == [0, 1]


def test_clamped_swiglu_matches_numpy():
    rng = np.random.default_rng(1)
    gate, up = (rng.normal(size=(64,)).astype(np.float32) * 6 for _ in range(2))
    alpha, limit = 1.702, 3.0
    g = np.minimum(gate.astype(np.float64), limit)
    u = np.clip(up.astype(np.float64), -limit, limit)
    want = (u + 1) * g / (1 + np.exp(-alpha * g))
    got = gated_hidden(ClampedSwiGLU(alpha, limit), jnp.asarray(gate), jnp.asarray(up))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_yarn_frequencies_match_transformers():
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
              "beta_slow": 1.0, "truncate": False,
              "original_max_position_embeddings": 4096}  # fmt: skip
    config = GptOssConfig(
        head_dim=64, num_attention_heads=4, hidden_size=256, rope_parameters=params
    )
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    plain = 1.0 / 150000.0 ** (np.arange(0, 64, 2, dtype=np.float64) / 64)
    got = yarn_inv_freq(plain, 150000.0, 32.0, 4096, 32.0, 1.0, truncate=False)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert yarn_attention_factor(32.0) == pytest.approx(factor)


def gpt_oss_like(moe_every: int = 1, **changes):
    config = base_config()
    m = config.model
    m.update(vocab_size=64, num_layers=4, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8)
    m.update(sliding_window=3, layer_types="sliding,full", attention_sinks=True, out_bias=True)
    m.update(qkv_bias=True, activation="swiglu_clamped", swiglu_limit=1.0)
    m.moe.update(num_experts=4, ffn_dim=16, gating="topk", top_k=2, renormalize=True)
    m.moe.update(router_bias=True, expert_bias=True, every=moe_every)
    m.update(**changes)
    return validate(config).model


def randomized(model, seed=0):
    """Every parameter (sinks and biases too) random, so none is a silent no-op."""
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [
        0.5 * jax.random.normal(k, x.shape, x.dtype) + (x if x.ndim == 1 else 0)
        for k, x in zip(keys, leaves, strict=True)
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


@pytest.mark.parametrize("scan", [pytest.param(False, marks=pytest.mark.slow), True])
def test_ring_cache_decode_equals_full_forward(scan):
    """Prefill 5 tokens (longer than the window), then 9 single steps: the sliding layers'
    caches stay 3 slots, the logits those of the full forward. Scanned: the stacked rings
    are written in place row by row (the unrolled ring is also test_hf_gpt_oss's greedy
    decode, hence slow here)."""
    # Scanned: a period of 2 layers (moe.every) matches the sliding/full alternation; its
    # dense layers take silu (the clamped SwiGLU is the experts').
    scanned = dict(scan_layers=True, moe_every=2, activation="silu")
    m = gpt_oss_like(**scanned) if scan else gpt_oss_like()
    model = randomized(DecoderLM(m, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, size=(2, 14)))
    full, _ = nnx.jit(lambda model, tokens: model(tokens))(model, tokens)
    step = nnx.jit(lambda model, tokens, cache: model(tokens, cache=cache))
    cache = init_cache(m, 2, 16)
    logits, _, cache = step(model, tokens[:, :5], cache)
    steps = [logits]
    for t in range(5, 14):
        logits, _, cache = step(model, tokens[:, t : t + 1], cache)
        steps.append(logits)
    lengths = sorted({c.v.shape[-2] for c in cache.layers})
    assert lengths == [3, 16]
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full), atol=1e-4)


def test_expert_biases_match_numpy_loop():
    m = gpt_oss_like(num_layers=1, sliding_window=0, layer_types="", attention_sinks=False)
    from jaxmoe.models.moe.layer import MoE

    moe = randomized(MoE.of_model(m, rngs=nnx.Rngs(1)), seed=2)
    x = np.random.default_rng(4).normal(size=(2, 5, 32)).astype(np.float32)
    got, _ = nnx.jit(lambda moe, x: moe(x, train=False))(moe, jnp.asarray(x))
    p = {k: np.asarray(v[...], np.float64) for k, v in nnx.state(moe, nnx.Param).items()}
    want = np.zeros((2, 5, 32))
    for b in range(2):
        for t in range(5):
            logits = x[b, t] @ p["router"] + p["router_bias"]
            top = np.argsort(-logits)[:2]
            weights = np.exp(logits[top] - logits[top].max())
            weights /= weights.sum()
            for w, e in zip(weights, top, strict=True):
                gate = x[b, t] @ p["wi_0"][e] + p["wi_0_bias"][e]
                up = x[b, t] @ p["wi_1"][e] + p["wi_1_bias"][e]
                g, u = np.minimum(gate, 1.0), np.clip(up, -1.0, 1.0)
                hidden = (u + 1) * g / (1 + np.exp(-1.702 * g))
                want[b, t] += w * (hidden @ p["wo"][e] + p["wo_bias"][e])
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)


def test_bad_keys_fail_in_one_line():
    with pytest.raises(ConfigError, match=r"model\.layer_types"):
        gpt_oss_like(layer_types="sliding,wide")
    with pytest.raises(ConfigError, match="scan_layers"):
        gpt_oss_like(scan_layers=True)  # every=1 scans one layer: kinds do not repeat
    with pytest.raises(ConfigError, match="swiglu_clamped"):
        gpt_oss_like(moe_every=2)  # dense layers cannot take the experts' activation
    assert parse_layer_types("sliding_attention,full", 4, 3) == ("sliding", "full") * 2


def test_biased_clamped_experts_under_expert_parallelism():
    """The ones column and the down bias through the expert-parallel exchange: outputs and
    gradients as on one device (mesh data 2 x expert 4)."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxmoe.models.moe.layer import MoE
    from jaxmoe.parallel import sharding
    from jaxmoe.parallel.mesh import MESH_AXES

    m = gpt_oss_like(num_layers=1, sliding_window=0, layer_types="", attention_sinks=False)
    moe = randomized(MoE.of_model(m, rngs=nnx.Rngs(1)), seed=5)
    graphdef, params = nnx.split(moe, nnx.Param)
    rest = nnx.state(moe, nnx.Not(nnx.Param))
    x = jnp.asarray(np.random.default_rng(6).normal(size=(8, 6, 32)), jnp.float32)

    @jax.jit
    def loss_and_grads(params, x):
        def loss(params, x):
            y, _ = nnx.merge(graphdef, params, rest)(x, train=False)
            return jnp.sum(y * jnp.cos(jnp.arange(32.0))), y

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    (_, want_y), want_grads = loss_and_grads(params, x)
    mesh = jax.make_mesh((2, 1, 1, 1, 4), MESH_AXES, axis_types=(AxisType.Auto,) * 5)
    params_on = jax.device_put(params, sharding.named(mesh, sharding.param_specs(params, mesh)))
    x_on = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp", "expert"))))
    with jax.set_mesh(mesh):
        (_, y), grads = loss_and_grads(params_on, x_on)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), atol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
