"""Multi-head latent attention (models/mla.py) against transformers' DeepseekV3Attention.

The reference is transformers' own module (PyTorch, eager attention) with random weights
copied into jaxmoe's LatentAttention by hand (HF [out, in] -> jaxmoe [in, out]); full-rank
and low-rank queries, default and YaRN rotary (with both mscales, so the rotary factor and
the softmax-scale correction are exercised). A model with `model.attention=mla` trains
(finite gradients for every parameter) through DecoderLM.__call__, scanned or not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from jaxmoe.config.loading import with_overrides
from jaxmoe.errors import ConfigError
from jaxmoe.models.mla import LatentAttention
from jaxmoe.models.options import ModelOptions
from tests.helpers import tiny_config

D, H, RANK, ROPE, NOPE, V = 32, 4, 16, 8, 10, 12
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
    "rope_theta": 10000.0,
}


def mla_model_config(q_rank: int, yarn: bool) -> ModelOptions:
    keys = dict(d_model=D, num_heads=H, attention="mla", q_lora_rank=q_rank, kv_lora_rank=RANK)
    keys |= dict(qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V)
    if yarn:
        keys |= dict(rope_type="yarn", rope_factor=4.0, rope_original_max_len=32)
        keys |= dict(rope_mscale=1.0, rope_mscale_all_dim=0.707)
    return ModelOptions(**keys)


def hf_attention(q_rank: int, yarn: bool):
    config = DeepseekV3Config(
        hidden_size=D, num_attention_heads=H, num_key_value_heads=H, kv_lora_rank=RANK,
        q_lora_rank=q_rank or None, qk_rope_head_dim=ROPE, v_head_dim=V,
        qk_nope_head_dim=NOPE, max_position_embeddings=128,
        **({"rope_parameters": YARN} if yarn else {}),
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = DeepseekV3Attention(config, 0).eval()
    for p in attention.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return attention, DeepseekV3RotaryEmbedding(config)


def copy_weights(hf, mine: LatentAttention, q_rank: int) -> None:
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    if q_rank:
        mine.q_down[...] = sd["q_a_proj.weight"].T
        mine.q_norm.scale[...] = sd["q_a_layernorm.weight"]
        mine.q_up[...] = sd["q_b_proj.weight"].T.reshape(q_rank, H, NOPE + ROPE)
    else:
        mine.query[...] = sd["q_proj.weight"].T.reshape(D, H, NOPE + ROPE)
    mine.kv_down[...] = sd["kv_a_proj_with_mqa.weight"].T
    mine.kv_norm.scale[...] = sd["kv_a_layernorm.weight"]
    mine.kv_up[...] = sd["kv_b_proj.weight"].T.reshape(RANK, H, NOPE + V)
    mine.out[...] = sd["o_proj.weight"].T.reshape(H, V, D)


@pytest.mark.parametrize("q_rank, yarn", [(0, False), (12, True)])
def test_latent_attention_matches_transformers(q_rank, yarn):
    hf, rotary = hf_attention(q_rank, yarn)
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(9)[None].expand(2, -1)
    causal = torch.full((9, 9), -1e9).triu(1)[None, None]
    with torch.no_grad():
        want = hf(x, rotary(x, positions), causal)[0].numpy()
    mine = LatentAttention(mla_model_config(q_rank, yarn), rngs=nnx.Rngs(0))
    copy_weights(hf, mine, q_rank)
    got = mine(jnp.asarray(x.numpy()), mask=jnp.tril(jnp.ones((9, 9), bool))[None])
    assert np.abs(want).max() > 0.5
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_mla_decoder_trains(scan):
    from jaxmoe.models import build_model

    config = tiny_config(
        "model.attention=mla", "model.q_lora_rank=8", "model.kv_lora_rank=16",
        "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6",
        f"model.scan_layers={scan}",
    )  # fmt: skip
    model = build_model(config.model, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 128)

    def loss(model):
        logits, _ = model(tokens[:, :-1], train=True)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    # One compiled program (as training runs it), not hundreds of op-by-op ones.
    value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
    assert np.isfinite(float(value))
    leaves = jax.tree.leaves(nnx.to_pure_dict(grads))
    assert leaves and all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert all(float(jnp.abs(g).max()) > 0 for g in leaves)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.attention=mla", "model.kv_lora_rank=0"], "model.kv_lora_rank=0"),
        (["model.attention=mla", "model.qk_rope_head_dim=5"], "must be even"),
        (["model.attention=mla", "model.qk_norm=head"], "no qkv_bias or qk_norm"),
        (["model.attention=gqa3"], "model.attention"),
    ],
)
def test_bad_mla_keys_are_one_line(overrides, needle):
    config = tiny_config()
    with pytest.raises((ConfigError, ValueError)) as info:
        with_overrides(config, overrides)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_gqa_pooling_refuses_mla():
    from jaxmoe.conversions.surgery import check_num_kv_heads

    config = tiny_config("model.attention=mla", "model.qk_rope_head_dim=4")
    with pytest.raises(ValueError) as info:
        check_num_kv_heads(config.model, 1, "mean", False)
    message = str(info.value)
    assert "model.attention='mla'" in message and "no key/value heads" in message
    assert "\n" not in message


def test_mla_flops_count_the_latent_projections():
    from jaxmoe.models.flops import forward_macs_per_sequence

    config = tiny_config(
        "model.attention=mla", "model.q_lora_rank=8", "model.kv_lora_rank=16",
        "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6",
        "model.moe.num_experts=0", "model.num_layers=1",
    )  # fmt: skip
    m, length = config.model, 10
    # By hand: q_down 32x8, q_up 8x(4 heads x 12), kv_down 32x20, kv_up 16x(4 x 14),
    # out (4 x 6)x32; scores 4 heads x (12 + 6) x L x L; SwiGLU 3 x 32 x 64; lm_head 32 x 128.
    projections = 32 * 8 + 8 * 48 + 32 * 20 + 16 * 56 + 24 * 32
    want = length * (projections + 3 * 32 * 64 + 32 * 128) + 4 * 18 * length * length
    assert forward_macs_per_sequence(m, length) == want
