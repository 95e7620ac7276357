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


def _model_config(kind: str, strategy: str = "all_gather"):
    from jaxmoe.config.defaults import base_config
    from jaxmoe.config.schema import typed

    c = base_config()
    m = c.model
    m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = VOCAB, 32, 2, 4, 2
    m.head_dim, m.ffn_dim, m.moe.ffn_dim, m.moe.num_experts = 8, 64, 32, 0
    m.attention_block = 0
    m.context_strategy = strategy
    if kind == "gqa_moe":  # layer 0 dense FFN, layer 1 MoE (dropless)
        m.moe.num_experts, m.moe.every, m.moe.gating = 4, 2, "topk"
        m.moe.dispatch = "ragged"
    elif kind == "mqa_window":
        m.num_kv_heads, m.sliding_window, m.layer_types = 1, 5, "sliding,full"
        m.attention_sinks = True
    elif kind == "mla":
        m.attention, m.kv_lora_rank, m.qk_nope_head_dim = "mla", 16, 8
        m.qk_rope_head_dim, m.v_head_dim, m.q_lora_rank = 4, 8, 12
    return typed(c).model


def _loss_fn(cfg, segments: bool):
    from jaxmoe.models.transformer import DecoderLM

    graphdef, params = nnx.split(DecoderLM(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (BATCH, LENGTH), 0, VOCAB)
    kwargs = {}
    if segments:  # row 0: documents of 5, 20 and 7 tokens; row 1: one of 32
        seg = np.ones((BATCH, LENGTH), np.int32)
        seg[0, 5:25], seg[0, 25:] = 2, 3
        starts = np.where(seg[0] != np.roll(seg[0], 1))[0]
        pos = np.arange(LENGTH)[None].repeat(BATCH, 0)
        for s in starts:
            pos[0, s:] = np.arange(LENGTH - s)
        kwargs = dict(segment_ids_BL=jnp.asarray(seg), positions_BL=jnp.asarray(pos))

    def loss(params):
        model = nnx.merge(graphdef, params)
        logits, aux = model(tokens, train=True, **kwargs)
        logp = jax.nn.log_softmax(logits[:, :-1])
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
        moe = sum(jnp.sum(a.get("balance_loss", 0.0)) for a in aux.values())
        return nll + 0.01 * moe

    return jax.jit(jax.value_and_grad(loss)), params


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
    ],
)
def test_split_sequence_matches_unsplit(kind, strategy, monkeypatch):
    from jaxmoe.models import attention_math

    # Pieces of 8 queries: two per device at mesh.context=2, one beyond.
    monkeypatch.setattr(attention_math, "PIECE_SCORE_BYTES", 4 * 4 * 8 * LENGTH)
    step, params = _loss_fn(_model_config(kind, strategy), segments=False)
    want_loss, want_grads = step(params)
    for context in (2, 4, 8):
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


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_packed_documents_split_match_unsplit(strategy, monkeypatch):
    from jaxmoe.models import attention_math

    monkeypatch.setattr(attention_math, "PIECE_SCORE_BYTES", 4 * 4 * 8 * LENGTH)
    step, params = _loss_fn(_model_config("gqa_moe", strategy), segments=True)
    want_loss, want_grads = step(params)
    for context in (2, 4, 8):
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
