"""configs/deepseek2_16b.py has DeepSeek-V2-Lite's sizes: the same parameter count as
transformers' DeepseekV2ForCausalLM from the checkpoint's config.json values (meta device,
nothing allocated); `:tiny` is the same design at test size, counted the same way."""

import pytest

from jaxmoe.config.loading import load_config
from tests.helpers import abstract_param_count

CONFIG = "configs/deepseek2_16b.py"
# deepseek-ai/DeepSeek-V2-Lite's config.json (the values that size or shape the model).
DEEPSEEK_V2_LITE = {
    "vocab_size": 102400,
    "hidden_size": 2048,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "aux_loss_alpha": 0.001,
}


def _hf_count(hf: dict) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = {k: v for k, v in hf.items() if k != "aux_loss_alpha"}
    config = transformers.DeepseekV2Config(**hf, head_dim=hf["qk_rope_head_dim"])
    with torch.device("meta"):
        model = transformers.DeepseekV2ForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def _as_hf(config) -> dict:
    """The config.json a jaxmoe model config stands for (written out by hand here)."""
    m, moe = config.model, config.model.moe
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "q_lora_rank": m.q_lora_rank or None,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "intermediate_size": m.ffn_dim,
        "moe_intermediate_size": moe.ffn_dim,
        "n_routed_experts": moe.num_experts,
        "n_shared_experts": moe.num_shared_experts,
        "num_experts_per_tok": moe.gate.top_k,
        "first_k_dense_replace": moe.first_dense_layers,
        "norm_topk_prob": moe.gate.renormalize,
        "routed_scaling_factor": moe.router.routed_scaling_factor,
        "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings,
        "aux_loss_alpha": moe.balance_loss_weight,
    }


@pytest.mark.slow  # transformers builds 27 layers x 64 experts on the meta device
def test_full_config_is_deepseek_v2_lite():
    config = load_config(CONFIG)
    assert _as_hf(config) == DEEPSEEK_V2_LITE
    m = config.model
    assert (m.attention, m.rope_type, m.rope_factor, m.rope_original_max_len) == (
        "mla", "yarn", 40.0, 4096,
    )  # fmt: skip
    assert m.moe.shared_ffn_dim == m.moe.ffn_dim  # 2 shared experts of 1408
    assert abstract_param_count(config) == _hf_count(DEEPSEEK_V2_LITE)
    t = config.train
    assert (t.batch_size, t.seq_len, t.grad_accum, config.mesh.expert) == (64, 4096, 1, 8)


def test_tiny_variant_counts_as_transformers():
    config = load_config(f"{CONFIG}:tiny")
    assert config.model.attention == "mla" and config.model.moe.first_dense_layers == 1
    assert abstract_param_count(config) == _hf_count(_as_hf(config))
