"""Today's MoE designs (issue 27): shared experts, sigmoid / biased / group-limited routing,
dense-layer placement, QK-norm and the sequence-wise balance loss.

References: transformers' own PyTorch modules built with the same weights
(Qwen2MoeSparseMoeBlock, DeepseekV3MoE, Qwen3MoeAttention, OlmoeAttention), a per-token
numpy loop for the router, HF's layer-placement rules written out, hand-computed losses.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxmoe.config.loading import with_overrides
from jaxmoe.errors import ConfigError
from jaxmoe.models import build_model
from jaxmoe.models.attention import Attention
from jaxmoe.models.layer_kinds import is_moe_layer
from jaxmoe.models.moe import router
from jaxmoe.models.moe.layer import MoE
from tests import test_one_forward
from tests.helpers import tiny_config

D, E = 32, 8


def moe_model_cfg(*overrides):
    return tiny_config("model.moe.num_experts=8", "model.moe.dispatch=blocks", *overrides).model


def moe_layer(*overrides, seed=0):
    layer = MoE.of_model(moe_model_cfg(*overrides), rngs=nnx.Rngs(seed))
    if hasattr(layer, "selection_bias"):  # a bias that changes choices (scores are in [0, 1])
        bias = np.random.default_rng(seed + 1).normal(0, 0.3, E)
        layer.selection_bias[...] = jnp.asarray(bias, jnp.float32)
    return layer


def tokens(seed=0, batch=2, length=5):
    return np.random.default_rng(seed).normal(size=(batch, length, D)).astype(np.float32)


def t(a):
    return torch.tensor(np.asarray(a, np.float32))


def load_experts(hf_experts, layer):
    """jaxmoe's wi_0 / wi_1 [E, D, F], wo [E, F, D] into HF's fused gate_up / down."""
    wi_0, wi_1, wo = (np.asarray(w[...]) for w in (layer.wi_0, layer.wi_1, layer.wo))
    hf_experts.gate_up_proj.data = t(np.concatenate([wi_0, wi_1], axis=2).transpose(0, 2, 1))
    hf_experts.down_proj.data = t(wo.transpose(0, 2, 1))


def load_mlp(hf_mlp, mlp):
    hf_mlp.gate_proj.weight.data = t(np.asarray(mlp.wi_0[...]).T)
    hf_mlp.up_proj.weight.data = t(np.asarray(mlp.wi_1[...]).T)
    hf_mlp.down_proj.weight.data = t(np.asarray(mlp.wo[...]).T)


# ---------------------------------------------------------------------------------------
# Item 1-2: against transformers' modules.


@pytest.mark.parametrize("norm", [False, True])
def test_qwen2_moe_block_matches_transformers(norm):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    layer = moe_layer(
        "model.moe.gating=topk",
        "model.moe.top_k=2",
        f"model.moe.renormalize={norm}",
        "model.moe.num_shared_experts=1",
        "model.moe.shared_ffn_dim=24",
        "model.moe.shared_expert_gate=true",
    )
    hf_cfg = Qwen2MoeConfig(
        hidden_size=D,
        num_experts=E,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=24,
        norm_topk_prob=norm,
        hidden_act="silu",
    )
    block = Qwen2MoeSparseMoeBlock(hf_cfg).eval()
    block.gate.weight.data = t(np.asarray(layer.router[...]).T)
    load_experts(block.experts, layer)
    load_mlp(block.shared_expert, layer.shared)
    block.shared_expert_gate.weight.data = t(np.asarray(layer.shared_gate.kernel[...]).T)
    x = tokens()
    with torch.no_grad():
        expected = block(t(x)).numpy()
    y, _ = layer(jnp.asarray(x), train=False)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [(1, 1), (4, 2)], ids=["no_groups", "4_groups_pick_2"])
def test_deepseek_v3_moe_matches_transformers(groups):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    n_group, topk_group = groups
    layer = moe_layer(
        "model.moe.gating=topk",
        "model.moe.top_k=3",
        "model.moe.renormalize=true",
        "model.moe.router_scoring=sigmoid",
        "model.moe.selection_bias=true",
        f"model.moe.n_group={n_group}",
        f"model.moe.topk_group={topk_group}",
        "model.moe.routed_scaling_factor=2.5",
        "model.moe.num_shared_experts=2",
    )
    hf_cfg = DeepseekV3Config(
        hidden_size=D,
        n_routed_experts=E,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        n_shared_experts=2,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        hidden_act="silu",
    )
    moe = DeepseekV3MoE(hf_cfg).eval()
    moe.gate.weight.data = t(np.asarray(layer.router[...]).T)
    moe.gate.e_score_correction_bias.data = t(layer.selection_bias[...])
    load_experts(moe.experts, layer)
    load_mlp(moe.shared_experts, layer.shared)
    x = tokens(1, batch=3, length=7)
    with torch.no_grad():
        expected = moe(t(x)).numpy()
    y, _ = layer(jnp.asarray(x), train=False)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# The router rule against a per-token numpy loop.


def ref_route(logits, bias, scoring, n_group, topk_group, k, renorm, scale):
    """One token at a time, in float64: (chosen expert sets, weight per chosen expert)."""
    out = []
    for row in logits.astype(np.float64):
        if scoring == "sigmoid":
            scores = 1 / (1 + np.exp(-row))
        else:
            scores = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        choice = scores + (bias if bias is not None else 0)
        size = len(row) // n_group
        group_scores = [sorted(choice[g * size : (g + 1) * size])[-2:] for g in range(n_group)]
        best = sorted(range(n_group), key=lambda g: -sum(group_scores[g]))[:topk_group]
        allowed = [e for e in range(len(row)) if e // size in best]
        chosen = sorted(allowed, key=lambda e: -choice[e])[:k]
        w = np.array([scores[e] for e in chosen])
        if renorm:
            w = w / (w.sum() + (1e-20 if scoring == "sigmoid" else 0))
        out.append(dict(zip(chosen, w * scale, strict=True)))
    return out


@pytest.mark.parametrize(
    "scoring,biased,n_group,topk_group,k,renorm,scale",
    [
        ("softmax", True, 1, 1, 2, False, 1.0),
        ("softmax", False, 4, 2, 3, True, 1.0),
        ("sigmoid", False, 1, 1, 2, False, 1.0),
        ("sigmoid", True, 4, 1, 2, True, 2.5),
        ("sigmoid", True, 2, 1, 4, False, 16.0),
    ],
)
def test_router_matches_a_per_token_loop(scoring, biased, n_group, topk_group, k, renorm, scale):
    rng = np.random.default_rng(k)
    logits = rng.normal(size=(40, E)).astype(np.float32)
    bias = rng.normal(0, 0.3, E).astype(np.float32) if biased else None
    rcfg = router.RouterOptions(scoring, scale, biased, n_group, topk_group)
    from jaxmoe.models.moe.gates import GateOptions

    gate = GateOptions(gating="topk", top_k=k, renormalize=renorm)
    scores = router.router_scores(jnp.asarray(logits), scoring)
    routing = router.route(scores, None if bias is None else jnp.asarray(bias), rcfg, gate)
    expected = ref_route(logits, bias, scoring, n_group, topk_group, k, renorm, scale)
    for token, want in enumerate(expected):
        chosen = np.asarray(routing.indices[token]).tolist()
        got = dict(zip(chosen, np.asarray(routing.weights[token]), strict=True))
        assert set(got) == set(want)
        for e, w in want.items():
            np.testing.assert_allclose(float(got[e]), w, rtol=2e-6)


def test_selection_bias_changes_choice_not_weights():
    """A large bias on expert 7 puts it in every token's choice with its unbiased score."""
    layer = moe_layer("model.moe.gating=topk", "model.moe.selection_bias=true")
    layer.selection_bias[...] = jnp.zeros(E).at[7].set(100.0)
    logits, _, routing = layer.route(jnp.asarray(tokens()), train=False)
    assert np.all(np.any(np.asarray(routing.indices) == 7, axis=1))
    slot = np.argmax(np.asarray(routing.indices) == 7, axis=1)
    weight7 = np.asarray(routing.weights)[np.arange(len(slot)), slot]
    np.testing.assert_allclose(weight7, np.asarray(jax.nn.softmax(logits))[:, 7], rtol=1e-6)


def test_selection_bias_gets_no_gradient():
    layer = moe_layer("model.moe.gating=topk", "model.moe.selection_bias=true")
    graphdef, params = nnx.split(layer, nnx.Param)

    def loss(params):
        y, aux = nnx.merge(graphdef, params)(jnp.asarray(tokens()), train=True)
        return jnp.sum(y**2) + aux["balance_loss"]

    grads = jax.grad(loss)(params)
    assert not np.any(np.asarray(grads["selection_bias"][...]))
    assert np.any(np.asarray(grads["router"][...]))


def test_defaults_add_no_parameters_and_no_loss():
    layer = moe_layer()
    _, params = nnx.split(layer, nnx.Param)
    assert set(nnx.to_pure_dict(params)) == {"router", "wi_0", "wi_1", "wo"}
    _, aux = layer(jnp.asarray(tokens()), train=True)
    assert "sequence_balance_loss" not in aux


def test_ungated_shared_expert_is_a_plain_mlp():
    layer = moe_layer(
        "model.ffn_gated=false", "model.activation=relu", "model.moe.num_shared_experts=2"
    )
    assert layer.shared.wi.shape == (D, 2 * 32)  # shared_ffn_dim 0: moe.ffn_dim per expert
    x = jnp.asarray(tokens())
    routed = MoE.__call__  # the routed part alone: the same layer without the shared FFN
    shared = layer.shared
    y, _ = layer(x, train=False)
    del layer.shared
    y_routed, _ = routed(layer, x, train=False)
    xs = np.asarray(x, np.float64)
    expected = np.maximum(xs @ np.asarray(shared.wi[...]), 0) @ np.asarray(shared.wo[...])
    np.testing.assert_allclose(np.asarray(y - y_routed), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Sequence-wise balance loss, by hand.


def test_sequence_balance_loss_by_hand():
    # One sequence of 2 tokens, E = 4, K = 2 (+ a padded third token that must not count).
    scores = np.array(
        [[[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.9, 0.05, 0.03, 0.02]]], np.float32
    )
    indices = np.array([[[0, 1], [3, 2], [0, 1]]], np.int32)
    mask = np.ones((1, 3, 2), bool)
    real = np.array([[True, True, False]])
    # f = counts / tokens = [1, 1, 1, 1] / 2; P = mean scores = [.25, .25, .25, .25]
    # E / K * sum f P = 4 / 2 * (4 * 0.5 * 0.25) = 1.0
    got = router.sequence_balance_loss(scores, indices, mask, real)
    np.testing.assert_allclose(float(got), 1.0, rtol=1e-6)
    # Both tokens on experts 0, 1: f = [1, 1, 0, 0]; P = [.25, .25, .25, .25] -> 2 * 0.5 = 1.0;
    # with the first token's scores twice: P = [.4, .3, .2, .1] -> 2 * (0.4 + 0.3) = 1.4.
    indices2 = np.array([[[0, 1], [0, 1], [2, 3]]], np.int32)
    scores2 = np.array([[[0.4, 0.3, 0.2, 0.1]] * 3], np.float32)
    got2 = router.sequence_balance_loss(scores2, indices2, mask, real)
    np.testing.assert_allclose(float(got2), 1.4, rtol=1e-6)
    # Two sequences: the mean of the two.
    both = router.sequence_balance_loss(
        np.concatenate([scores, scores2]),
        np.concatenate([indices, indices2]),
        np.concatenate([mask, mask]),
        np.concatenate([real, real]),
    )
    np.testing.assert_allclose(float(both), 1.2, rtol=1e-6)


def test_sequence_balance_loss_reaches_the_train_loss():
    from jaxmoe.training.steps import _loss, step_fns

    cfg = tiny_config(
        "model.moe.num_experts=4",
        "model.moe.gating=topk",
        "model.moe.router_scoring=sigmoid",
        "model.moe.sequence_balance_weight=0.5",
        "model.moe.balance_loss_weight=0",
        "model.moe.z_loss_weight=0",
    )
    model = build_model(cfg.model, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    spec = type("Spec", (), {"graphdef": graphdef, "rest": None})()
    fns = step_fns(cfg.train, cfg.optimizer, cfg.model, spec, None, lambda s: 0.0)
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, 128, (2, 16)).astype(np.int32)
    batch = {"inputs": inputs, "targets": inputs, "weights": np.ones((2, 16), np.float32)}
    loss, extra = _loss(params, batch, 32.0, None, fns)
    _, aux = model(inputs, train=True, token_mask_BL=batch["weights"] > 0)
    seq = sum(float(a["sequence_balance_loss"]) for a in aux.values())
    np.testing.assert_allclose(float(extra["weighted_sequence_balance_loss"]), 0.5 * seq, 1e-6)
    np.testing.assert_allclose(float(loss), float(extra["nll_sum"]) / 32 + 0.5 * seq, 1e-5)


# ---------------------------------------------------------------------------------------
# Item 4: dense-layer placement.


def test_is_moe_layer_follows_hf_placement():
    def cfg(*o):
        return tiny_config("model.num_layers=8", *o).model

    # Qwen2/3-MoE: MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    qwen = cfg("model.moe.every=2", "model.moe.dense_layers=1,4,6")
    want = [i not in (1, 4, 6) and (i + 1) % 2 == 0 for i in range(8)]
    assert [is_moe_layer(qwen, i) for i in range(8)] == want
    # DeepSeek: MoE iff i >= first_k_dense_replace (and moe_layer_freq = 1).
    deepseek = cfg("model.moe.first_dense_layers=3")
    assert [is_moe_layer(deepseek, i) for i in range(8)] == [i >= 3 for i in range(8)]
    model = build_model(deepseek, rngs=nnx.Rngs(0))
    kinds = [type(block.ffn).__name__ for block in model.layers]
    assert kinds == ["GatedMLP"] * 3 + ["MoE"] * 5


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("model.moe.dense_layers=1,x",), "model.moe.dense_layers"),
        (("model.moe.dense_layers=9",), "layer 9 >= num_layers"),
        (("model.moe.first_dense_layers=2",), "leave no MoE layer"),
        # Dense layer 1 behind MoE layer 0: not a dense prefix, no scan.
        (("model.num_layers=3", "model.moe.dense_layers=1", "model.scan_layers=true"), "layer 1"),
    ],
)
def test_placement_checks(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(*overrides)


@pytest.mark.parametrize(
    "placement", ["model.moe.first_dense_layers=1", "model.moe.dense_layers=0"]
)
def test_scan_unrolls_a_dense_prefix_before_the_periods(placement):
    """DeepSeek's first_k_dense_replace / Qwen's mlp_only_layers = [0]: layer 0 is the
    unrolled head, layers 1-3 one scanned MoE block stacked 3 deep."""
    cfg = tiny_config("model.num_layers=4", placement, "model.scan_layers=true").model
    layers = build_model(cfg, rngs=nnx.Rngs(0)).layers
    assert [type(block.ffn).__name__ for block in layers.head] == ["GatedMLP"]
    assert [type(block.ffn).__name__ for block in layers.period] == ["MoE"]
    assert (layers.num_periods, len(layers.tail)) == (3, 0)


def test_scan_accepts_dense_layers_the_every_rule_already_has():
    cfg = tiny_config(
        "model.num_layers=4", "model.moe.every=2", "model.moe.dense_layers=0,2",
        "model.scan_layers=true",
    ).model  # fmt: skip
    assert [is_moe_layer(cfg, i) for i in range(4)] == [False, True, False, True]
    build_model(cfg, rngs=nnx.Rngs(0))


# ---------------------------------------------------------------------------------------
# Option checks: one line naming the key.


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("model.moe.router_scoring=tanh",), "model.moe.router_scoring"),
        (("model.moe.gating=topk", "model.moe.n_group=3"), "model.moe.n_group=3 must"),
        (("model.moe.gating=topk", "model.moe.n_group=8"), "needs >= 2"),
        (("model.moe.gating=topk", "model.moe.n_group=2", "model.moe.topk_group=3"), "topk_group"),
        (
            ("model.moe.gating=topk", "model.moe.top_k=5", "model.moe.n_group=2"),
            "model.moe.top_k: 5 experts",
        ),
        (("model.moe.bias_update_rate=0.01",), "needs model.moe.selection_bias"),
        (("model.moe.shared_expert_gate=true",), "needs model.moe.num_shared_experts"),
        (("model.moe.num_shared_experts=-1",), "model.moe.num_shared_experts"),
        (("model.moe.routed_scaling_factor=0",), "routed_scaling_factor"),
        (("model.moe.gating=top_p", "model.moe.router_scoring=sigmoid"), "top-k gate"),
        (("model.moe.gating=top_p", "model.moe.selection_bias=true"), "top-k gate"),
        (("model.qk_norm=rms",), "model.qk_norm"),
    ],
)
def test_option_checks(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config("model.moe.num_experts=8", *overrides)


def test_qk_norm_decoder_only():
    with pytest.raises(ConfigError, match=r"model\.qk_norm='head' is implemented for decoder"):
        with_overrides(tiny_config(), ["model.arch=encoder_decoder", "model.qk_norm=head"])


# ---------------------------------------------------------------------------------------
# Item 5: QK-norm.


def hf_attention_pair(kind):
    """(HF attention module, its rotary module, jaxmoe Attention) with the same weights."""
    heads, kv_heads, dh = 4, 2, 8
    common = dict(
        hidden_size=D,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        attention_bias=False,
    )
    if kind == "head":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe import modeling_qwen3_moe as mod

        hf_cfg = Qwen3MoeConfig(head_dim=dh, **common)
        attn, rotary = mod.Qwen3MoeAttention(hf_cfg, 0), mod.Qwen3MoeRotaryEmbedding(hf_cfg)
    else:
        from transformers import OlmoeConfig
        from transformers.models.olmoe import modeling_olmoe as mod

        hf_cfg = OlmoeConfig(**common)
        attn, rotary = mod.OlmoeAttention(hf_cfg, 0), mod.OlmoeRotaryEmbedding(hf_cfg)
    hf_cfg._attn_implementation = "eager"
    ours = Attention(
        D, heads, kv_heads, dh, rope_theta=10000.0, qk_norm=kind, norm_eps=1e-6,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    rng = np.random.default_rng(3)
    ours.q_norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, ours.q_norm.scale.shape))
    ours.k_norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, ours.k_norm.scale.shape))
    attn.q_proj.weight.data = t(np.asarray(ours.query[...]).reshape(D, -1).T)
    attn.k_proj.weight.data = t(np.asarray(ours.key[...]).reshape(D, -1).T)
    attn.v_proj.weight.data = t(np.asarray(ours.value[...]).reshape(D, -1).T)
    attn.o_proj.weight.data = t(np.asarray(ours.out[...]).reshape(-1, D).T)
    attn.q_norm.weight.data = t(ours.q_norm.scale[...])
    attn.k_norm.weight.data = t(ours.k_norm.scale[...])
    return attn.eval(), rotary, ours


@pytest.mark.parametrize("kind", ["head", "projection"])
def test_qk_norm_matches_transformers(kind):
    attn, rotary, ours = hf_attention_pair(kind)
    b, length = 2, 6
    x = tokens(4, batch=b, length=length) * 3.0  # unnormalised: the norms matter
    positions = torch.arange(length)[None].expand(b, length)
    causal = torch.full((length, length), float("-inf")).triu(1)[None, None].expand(b, 1, -1, -1)
    with torch.no_grad():
        cos_sin = rotary(t(x), positions)
        expected = attn(t(x), position_embeddings=cos_sin, attention_mask=causal)[0].numpy()
    mask = jnp.tril(jnp.ones((length, length), bool))[None]
    got = ours(jnp.asarray(x), mask=mask)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


QK_DECODERS = {
    "qk_head": ("model.moe.num_experts=0", "model.qk_norm=head"),
    "qk_projection_moe": ("model.moe.num_experts=4", "model.qk_norm=projection"),
    "deepseek_like": (
        "model.moe.num_experts=4",
        "model.moe.gating=topk",
        "model.moe.router_scoring=sigmoid",
        "model.moe.renormalize=true",
        "model.moe.selection_bias=true",
        "model.moe.n_group=2",
        "model.moe.num_shared_experts=1",
        "model.moe.shared_expert_gate=true",
        "model.qk_norm=head",
    ),
}


@test_one_forward.LAYOUTS
@pytest.mark.parametrize("name", list(QK_DECODERS))
def test_qk_norm_cached_decoding_gives_the_full_forward(name, layout, monkeypatch):
    """tests/test_one_forward.py's check (cached decoding == full forward) on QK-norm models
    and a DeepSeek-style router with a gated shared expert."""
    monkeypatch.setitem(test_one_forward.DECODERS, name, QK_DECODERS[name])
    test_one_forward.test_cached_decoder_gives_the_full_forward_logits(name, layout)


def test_qk_norm_param_paths():
    model = build_model(tiny_config("model.qk_norm=projection").model, rngs=nnx.Rngs(0))
    _, params = nnx.split(model, nnx.Param)
    attn = nnx.to_pure_dict(params)["layers"][0]["attn"]
    assert attn["q_norm"]["scale"].shape == (4 * 8,)
    assert attn["k_norm"]["scale"].shape == (2 * 8,)


def test_flops_count_the_shared_experts():
    from jaxmoe.models.flops import ffn_macs_per_token

    base = ("model.moe.gating=topk", "model.moe.top_k=2")
    plain = ffn_macs_per_token(moe_model_cfg(*base), 0)
    shared = moe_model_cfg(
        *base, "model.moe.num_shared_experts=2", "model.moe.shared_ffn_dim=24",
        "model.moe.shared_expert_gate=true",
    )  # fmt: skip
    # D = 32: 2 x 24 hidden units of a gated FFN (3 matrices), plus the gate's D.
    assert ffn_macs_per_token(shared, 0) - plain == 3 * 32 * 48 + 32
