"""mesh.context: the loss and every gradient with the sequence split over 2, 4 and 8
simulated devices equal the unsplit model's (f32), for GQA with dense and MoE layers, MQA
with sliding windows and sinks, MLA, and packed documents."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.models.context_parallel import load_balanced_order
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.options import MeshOptions

LENGTH, BATCH, VOCAB = 32, 2, 64


def test_load_balanced_order_pairs_early_and_late_chunks():
    order = load_balanced_order(16, 4)  # 8 chunks of 2: device i holds chunks i and 7 - i
    want = [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert order.tolist() == want
    # Every device has the same number of (query, earlier-or-same key) pairs.
    pairs = [int(sum(q + 1 for q in order[i * 4 : (i + 1) * 4])) for i in range(4)]
    assert len(set(pairs)) == 1
    with pytest.raises(ValueError, match=r"multiple of 2 x mesh\.context = 6"):
        load_balanced_order(16, 3)


def _model_config(kind: str, strategy: str = "all_gather", kernel: str = "xla"):
    from jaxmoe.config.defaults import base_config
    from jaxmoe.config.schema import typed

    c = base_config()
    m = c.model
    m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = VOCAB, 32, 2, 4, 2
    m.head_dim, m.ffn_dim, m.moe.ffn_dim, m.moe.num_experts = 8, 64, 32, 0
    m.attention_block = 0
    m.context_strategy = strategy
    m.attention_kernel = kernel
    if kind.startswith("gqa_moe"):  # layer 0 dense FFN, layer 1 MoE (dropless)
        m.moe.num_experts, m.moe.every, m.moe.gating = 4, 2, "topk"
        m.moe.dispatch = "ragged"
    if kind == "gqa_moe_window":  # layer 0 also a sliding window of 13 keys
        m.sliding_window, m.layer_types = 13, "sliding,full"
    elif kind == "mqa_window":
        m.num_kv_heads, m.sliding_window, m.layer_types = 1, 5, "sliding,full"
        m.attention_sinks = True
    elif kind == "mla":
        m.attention, m.kv_lora_rank, m.qk_nope_head_dim = "mla", 16, 8
        m.qk_rope_head_dim, m.v_head_dim, m.q_lora_rank = 4, 8, 12
    return typed(c).model


def _loss_fn(cfg, segments: bool, length: int = LENGTH):
    from jaxmoe.models.transformer import DecoderLM

    graphdef, params = nnx.split(DecoderLM(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (BATCH, length), 0, VOCAB)
    kwargs = {}
    if segments:  # row 0: documents of 5, 20 and the rest; row 1: one document
        seg = np.ones((BATCH, length), np.int32)
        seg[0, 5:25], seg[0, 25:] = 2, 3
        starts = np.where(seg[0] != np.roll(seg[0], 1))[0]
        pos = np.arange(length)[None].repeat(BATCH, 0)
        for s in starts:
            pos[0, s:] = np.arange(length - s)
        kwargs = dict(segment_ids_BL=jnp.asarray(seg), positions_BL=jnp.asarray(pos))

    def loss(params):
        model = nnx.merge(graphdef, params)
        logits, aux = model(tokens, train=True, **kwargs)
        logp = jax.nn.log_softmax(logits[:, :-1])
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
        moe = sum(jnp.sum(a.get("balance_loss", 0.0)) for a in aux.values())
        return nll + 0.01 * moe

    return jax.jit(jax.value_and_grad(loss)), params


# Ulysses splits the 4 query heads over the axis: at most 4 devices.
CONTEXTS = {"all_gather": (2, 4, 8), "ring": (2, 4, 8), "ulysses": (2, 4)}


def _split_run(step, params, context: int):
    mesh = make_mesh(MeshOptions(context=context))
    with jax.set_mesh(mesh):
        return step(params)


@pytest.mark.parametrize(
    "kind, strategy",
    [
        ("gqa_moe", "all_gather"),
        ("mqa_window", "all_gather"),
        ("mla", "all_gather"),
        ("mqa_window", "ring"),  # ring: window, sinks and MQA's one K/V head passed around
        # Ulysses: MQA's one K/V head repeated, the window, the sinks of each device's heads
        # (GQA with a dense and an MoE layer: the packed-documents test below).
        pytest.param("mqa_window", "ulysses", marks=pytest.mark.slow),
    ],
)
def test_split_sequence_matches_unsplit(kind, strategy, monkeypatch):
    from jaxmoe.models import attention_math

    # Pieces of 8 queries: two per device at mesh.context=2, one beyond.
    monkeypatch.setattr(attention_math, "PIECE_SCORE_BYTES", 4 * 4 * 8 * LENGTH)
    step, params = _loss_fn(_model_config(kind, strategy), segments=False)
    want_loss, want_grads = step(params)
    for context in CONTEXTS[strategy]:
        loss, grads = _split_run(step, params, context)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=f"context={context}")
        for path, got, want in zip(
            jax.tree_util.tree_leaves_with_path(grads),
            jax.tree.leaves(grads),
            jax.tree.leaves(want_grads),
            strict=True,
        ):
            np.testing.assert_allclose(
                got, want, rtol=2e-4, atol=2e-6, err_msg=f"context={context} {path[0]}"
            )


# Ulysses: GQA's 2 K/V heads split over 2 devices, repeated to 4 over 4 (slow: 20-35 s).
@pytest.mark.parametrize(
    "strategy", ["all_gather", "ring", pytest.param("ulysses", marks=pytest.mark.slow)]
)
def test_packed_documents_split_match_unsplit(strategy, monkeypatch):
    from jaxmoe.models import attention_math

    monkeypatch.setattr(attention_math, "PIECE_SCORE_BYTES", 4 * 4 * 8 * LENGTH)
    step, params = _loss_fn(_model_config("gqa_moe", strategy), segments=True)
    want_loss, want_grads = step(params)
    for context in CONTEXTS[strategy]:
        loss, grads = _split_run(step, params, context)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=f"context={context}")
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-6, err_msg=f"{context}")


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.seq_len=100", "train.seq_len=100 must be a multiple of 2 x mesh.context = 8"),
        ("model.dropout_rate=0.1", "no attention-probability dropout"),
        ("model.moe.capacity_factor=1.25", "needs dropless experts"),
    ],
)
def test_context_config_checks_name_the_key(override, message):
    from jaxmoe.config.defaults import base_config
    from jaxmoe.config.loading import apply_overrides
    from jaxmoe.config.schema import typed
    from jaxmoe.errors import ConfigError

    config = base_config()
    apply_overrides(config, ["mesh.context=4", override])
    with pytest.raises(ConfigError, match=re.escape(message)):
        typed(config)


# The kernels inside each device's chunks, against the unsplit model through jaxmoe's XLA
# path: GQA with a dense and an MoE layer, a sliding window of 13 keys on layer 0, packed
# documents; and MLA. Splash runs in Pallas' interpret mode (the kernel's code, on CPU) and needs
# 128 queries per device under all-gather (blocks of whole lanes): 512 tokens there.
# jax.nn.dot_product_attention runs its XLA lowering here: the masks, offsets and key
# ranges that cuDNN gets on GPU (tests/test_gpu_compile.py compiles that).
@pytest.mark.slow  # 8 interpret-mode or dot_product_attention compiles: 20-40 s each test
@pytest.mark.parametrize(
    "kernel, strategy, length, kind",
    [
        ("splash", "all_gather", 512, "gqa_moe_window"),
        ("splash", "ulysses", 128, "gqa_moe_window"),
        ("dot_product_attention", "all_gather", 32, "gqa_moe_window"),
        ("dot_product_attention", "ulysses", 32, "gqa_moe_window"),
        # MLA: the gathered latent's keys and values (padded to one width) in the kernel
        ("dot_product_attention", "all_gather", 32, "mla"),
    ],
)
def test_kernels_inside_chunks_match_unsplit(kernel, strategy, length, kind, monkeypatch):
    from jaxmoe.models import attention_kernel, attention_math

    monkeypatch.setattr(attention_math, "PIECE_SCORE_BYTES", 4 * 4 * 8 * length)
    calls = []  # every call of jax.nn's kernel from jaxmoe's attention code
    dpa = jax.nn.dot_product_attention
    monkeypatch.setattr(
        jax.nn, "dot_product_attention", lambda *a, **k: calls.append(1) or dpa(*a, **k)
    )
    unsplit_xla, _ = _loss_fn(_model_config(kind), True, length)
    step, params = _loss_fn(_model_config(kind, strategy, kernel), True, length)
    want_loss, want_grads = unsplit_xla(params)
    fell_back = attention_kernel.fallback_counts()
    for context in (2, 4):
        with jax.set_mesh(make_mesh(MeshOptions(context=context))):
            program = str(jax.make_jaxpr(step)(params))
        # The kernel ran in both layers: no XLA fallback.
        assert attention_kernel.fallback_counts() == fell_back
        if kernel == "splash":
            assert program.count("pallas_call") >= 2
        else:
            assert calls, "jax.nn.dot_product_attention was not called"
        loss, grads = _split_run(step, params, context)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=f"context={context}")
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-6, err_msg=f"{context}")


def test_splash_context_refusals_name_the_limit():
    from jaxmoe.models.context_kernels import splash_context_refusal
    from jaxmoe.models.ulysses_attention import kv_repeats, ulysses_refusal

    assert splash_context_refusal(512, 4) == ""
    assert "64 queries per context device" in splash_context_refusal(256, 4)
    assert "multiple of 128" in splash_context_refusal(96, 2)
    assert ulysses_refusal(8, 4) == "" and "6 heads" in ulysses_refusal(6, 4)
    assert (kv_repeats(2, 2), kv_repeats(2, 4), kv_repeats(1, 8), kv_repeats(6, 4)) == (1, 2, 8, 2)


def test_ulysses_refuses_heads_off_the_axis():
    from jaxmoe.config.defaults import base_config
    from jaxmoe.config.loading import apply_overrides
    from jaxmoe.config.schema import typed
    from jaxmoe.errors import ConfigError

    config = base_config()
    overrides = ["mesh.context=4", "model.context_strategy=ulysses", "model.num_heads=6"]
    apply_overrides(config, [*overrides, "model.num_kv_heads=2"])
    with pytest.raises(ConfigError, match=r"model\.num_heads=6 does not divide by 4"):
        typed(config)
