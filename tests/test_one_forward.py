"""One model call for training, prefill and cached decoding.

Cached decoding (a left-padded prefill, then one token per call, teacher forced) must give
the logits of the plain full forward at every position. The reference is the uncached call
of the UNROLLED model on the whole sequence (one seed builds the same parameters in either
stack layout), so a scanned cached decode is checked against code that shares neither its
scan, its stacked caches nor its attention read.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.models import build_model
from jaxmoe.models.kv_cache import init_cache
from jaxmoe.models.spec import model_params
from tests.helpers import TINY_T5, tiny_config

ATOL = RTOL = 2e-5  # float32; cached vs full attention differ only in summation order
SCANNED = ("model.scan_layers=true",)

DECODERS = {
    "dense_gqa": ("model.moe.num_experts=0",),
    "dense_mqa": ("model.moe.num_experts=0", "model.num_kv_heads=1"),
    # Interleaved MoE with a leftover layer: a scan of 2-block periods plus an unrolled tail.
    "moe_interleaved": ("model.moe.num_experts=4", "model.moe.every=2", "model.num_layers=3"),
    "moe_adaptive": ("model.moe.num_experts=4", "model.moe.gating=adaptive"),
    # DeepSeek's dense first layer: scanned, an unrolled head before the MoE periods.
    "moe_dense_head": (
        "model.moe.num_experts=4",
        "model.moe.first_dense_layers=1",
        "model.num_layers=3",
    ),
}
T5S = {
    "t5_gqa": (),
    # Switch Base-style: ungated ReLU FFNs, MoE every other layer, tied output layer.
    "switch_base": (
        "model.ffn_gated=false",
        "model.activation=relu",
        "model.tie_embeddings=true",
        "model.moe.num_experts=4",
        "model.moe.every=2",
        "model.moe.gating=top1",
        "model.num_layers=3",
    ),
}
LAYOUTS = pytest.mark.parametrize("layout", [(), SCANNED], ids=["unrolled", "scanned"])


def models(extra, layout, seed):
    """(model in `layout`, the same parameters as an unrolled model: the reference)."""
    cfg = tiny_config(*extra, *layout).model
    reference_cfg = tiny_config(*extra).model
    return (
        build_model(cfg, rngs=nnx.Rngs(seed)),
        build_model(reference_cfg, rngs=nnx.Rngs(seed)),
    )


def jitted(model):
    graphdef, params = model_params(model)
    return params, lambda fn: jax.jit(lambda params, *a: fn(nnx.merge(graphdef, params), *a))


@LAYOUTS
@pytest.mark.parametrize("name", list(DECODERS))
def test_cached_decoder_gives_the_full_forward_logits(name, layout):
    model, reference = models(DECODERS[name], layout, seed=0)
    cfg = model.cfg
    rng = np.random.default_rng(0)
    lengths, prompt_lengths, cache_len = [11, 7], [3, 5], 16
    seqs = [rng.integers(3, cfg.vocab_size, size=n).astype(np.int32) for n in lengths]
    # Reference: each sequence alone, uncached, unrolled (no padding anywhere).
    full = [np.asarray(jax.jit(lambda t: reference(t)[0])(s[None]))[0] for s in seqs]

    params, jit = jitted(model)
    step = jit(lambda m, tokens, cache: m(tokens, cache=cache))
    width = max(prompt_lengths)
    pad = np.array([width - p for p in prompt_lengths], np.int32)
    prompt = np.zeros((2, width), np.int32)
    for row, (s, p) in enumerate(zip(seqs, prompt_lengths, strict=True)):
        prompt[row, width - p :] = s[:p]
    logits, _, cache = step(params, prompt, init_cache(cfg, 2, cache_len, pad))
    assert int(cache.index) == width
    for row, p in enumerate(prompt_lengths):
        np.testing.assert_allclose(logits[row, width - p :], full[row][:p], ATOL, RTOL)
    for t in range(max(lengths) - min(prompt_lengths)):
        # Row r feeds its token number prompt_r + t (or a dummy once its sequence is over).
        pairs = zip(seqs, prompt_lengths, strict=True)
        tokens = [[s[p + t] if p + t < len(s) else 0] for s, p in pairs]
        logits, _, cache = step(params, np.array(tokens, np.int32), cache)
        for row, (s, p) in enumerate(zip(seqs, prompt_lengths, strict=True)):
            if p + t < len(s):
                np.testing.assert_allclose(logits[row, 0], full[row][p + t], ATOL, RTOL)
    assert int(cache.index) == width + max(lengths) - min(prompt_lengths)


@LAYOUTS
def test_prefill_last_only_is_the_last_position(layout):
    model, reference = models(DECODERS["dense_gqa"], layout, seed=1)
    tokens = np.arange(3, 11, dtype=np.int32)[None]
    full = np.asarray(reference(tokens)[0])
    logits, _, _ = model(tokens, cache=init_cache(model.cfg, 1, 16), last_only=True)
    assert logits.shape == (1, 1, model.cfg.vocab_size)
    np.testing.assert_allclose(logits[0, 0], full[0, -1], ATOL, RTOL)


@LAYOUTS
@pytest.mark.parametrize("name", list(T5S))
def test_cached_encoder_decoder_gives_the_full_forward_logits(name, layout):
    model, reference = models((*TINY_T5, *T5S[name]), layout, seed=2)
    cfg = model.cfg
    rng = np.random.default_rng(1)
    encoder = rng.integers(3, cfg.vocab_size, size=(2, 9)).astype(np.int32)
    encoder[1, 6:] = 0  # padding, masked in both attentions
    decoder = np.concatenate(
        [np.zeros((2, 1), np.int32), rng.integers(3, cfg.vocab_size, size=(2, 7))], axis=1
    ).astype(np.int32)
    full = np.asarray(jax.jit(lambda e, d: reference(e, d)[0])(encoder, decoder))

    params, jit = jitted(model)
    step = jit(lambda m, encoder, tokens, cache: m(encoder, tokens, cache=cache))
    # First call: the encoder runs and its cross K/V enter the cache; then one token a call.
    logits, _, cache = step(params, encoder, decoder[:, :3], init_cache(cfg, 2, 16))
    np.testing.assert_allclose(logits, full[:, :3], ATOL, RTOL)
    decode = jit(lambda m, tokens, cache: m(None, tokens, cache=cache))
    for t in range(3, decoder.shape[1]):
        logits, _, cache = decode(params, decoder[:, t : t + 1], cache)
        np.testing.assert_allclose(logits[:, 0], full[:, t], ATOL, RTOL)


def decode_step_size(num_layers: int, scan: bool) -> int:
    """Equations in the jaxpr of one cached decode step (nested jaxprs counted)."""
    layout = SCANNED if scan else ()
    cfg = tiny_config("model.moe.num_experts=0", f"model.num_layers={num_layers}", *layout)
    model = build_model(cfg.model, rngs=nnx.Rngs(0))
    cache = init_cache(cfg.model, 1, 16)
    jaxpr = jax.make_jaxpr(lambda t, c: model(t, cache=c)[::2])(jnp.zeros((1, 1), jnp.int32), cache)

    def count(jaxpr) -> int:
        return sum(
            1 + sum(count(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params))
            for eqn in jaxpr.eqns
        )

    return count(jaxpr.jaxpr)


def test_scanned_decode_program_does_not_grow_with_depth():
    assert decode_step_size(2, scan=True) == decode_step_size(8, scan=True)
    assert decode_step_size(8, scan=False) > 3 * decode_step_size(2, scan=False) // 2


def test_caches_of_the_other_layout_are_refused():
    scanned = build_model(tiny_config(*DECODERS["dense_gqa"], *SCANNED).model, rngs=nnx.Rngs(0))
    unrolled_cfg = tiny_config(*DECODERS["dense_gqa"]).model
    with pytest.raises(ValueError, match=r"DecoderLM: caches laid out as \[None, None\]"):
        scanned(np.ones((1, 1), np.int32), cache=init_cache(unrolled_cfg, 1, 16))
