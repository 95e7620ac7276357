"""configs/deepseek3_671b.py and configs/kimi_k2.py have their models' published sizes: the
same parameter count as transformers' DeepseekV3ForCausalLM built from the checkpoints'
config.json values (meta device, nothing allocated), DeepSeek-V3's MTP module counted
against transformers' own decoder layer; their `:tiny` variants train (MTP loss reported
beside the main one; MuonClip's attention maxima reported)."""

import jax
import numpy as np
import pytest

from jaxmoe.config.loading import load_config
from jaxmoe.models.spec import model_spec
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.training.optimizer import make_optimizer
from jaxmoe.training.state import init_state, state_shardings
from jaxmoe.training.steps import jit_train_step, step_fns
from tests.helpers import abstract_param_count, synthetic_batches

# deepseek-ai/DeepSeek-V3's and moonshotai/Kimi-K2-Instruct's config.json (the values that
# size or shape the model).
DEEPSEEK_V3 = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_theta": 10000.0, "num_nextn_predict_layers": 1,
}  # fmt: skip
KIMI_K2 = DEEPSEEK_V3 | {
    "vocab_size": 163840, "num_attention_heads": 64, "num_key_value_heads": 64,
    "n_routed_experts": 384, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.827, "rope_theta": 50000.0, "num_nextn_predict_layers": 0,
}  # fmt: skip
ROPE = {
    "configs/deepseek3_671b.py": (40.0, 4096, 32.0, 1.0),
    "configs/kimi_k2.py": (32.0, 4096, 1.0, 1.0),
}


def as_hf(config) -> dict:
    """The config.json a jaxmoe model config stands for (written out by hand here)."""
    m, moe = config.model, config.model.moe
    return {
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.ffn_dim,
        "moe_intermediate_size": moe.ffn_dim, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads,
        "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim, "n_routed_experts": moe.num_experts,
        "n_shared_experts": moe.num_shared_experts, "num_experts_per_tok": moe.gate.top_k,
        "first_k_dense_replace": moe.first_dense_layers, "n_group": moe.router.n_group,
        "topk_group": moe.router.topk_group, "norm_topk_prob": moe.gate.renormalize,
        "routed_scaling_factor": moe.router.routed_scaling_factor, "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "rope_theta": m.rope_theta,
        "num_nextn_predict_layers": m.mtp_depth,
    }  # fmt: skip


def hf_counts(hf: dict) -> tuple[int, int]:
    """(transformers' parameter count of the main model, of one MTP module: its decoder
    layer plus enorm, hnorm, shared_head.norm and eh_proj)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    kwargs = {k: v for k, v in hf.items() if k != "num_nextn_predict_layers"}
    config = transformers.DeepseekV3Config(**kwargs)
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(config)
        layer = DeepseekV3DecoderLayer(config, layer_idx=hf["num_hidden_layers"])
    d = hf["hidden_size"]
    return stored_count(model), stored_count(layer) + 3 * d + 2 * d * d


def stored_count(module) -> int:
    """Numbers a checkpoint of `module` holds: its parameters and the routers' selection
    bias (`e_score_correction_bias`, a buffer in transformers, jaxmoe's `selection_bias`)."""
    biases = (b for name, b in module.named_buffers() if name.endswith("e_score_correction_bias"))
    return sum(p.numel() for p in module.parameters()) + sum(b.numel() for b in biases)


@pytest.mark.slow  # transformers builds 61 layers of 256-384 experts on the meta device
@pytest.mark.parametrize(
    "path, published", [("configs/deepseek3_671b.py", DEEPSEEK_V3), ("configs/kimi_k2.py", KIMI_K2)]
)
def test_full_configs_have_the_published_sizes(path, published):
    config = load_config(path)
    assert as_hf(config) == published
    m = config.model
    assert (m.attention, m.rope_type, m.moe.router.router_scoring, m.moe.router.selection_bias) == (
        "mla", "yarn", "sigmoid", True,
    )  # fmt: skip
    assert (m.rope_factor, m.rope_original_max_len, m.rope_beta_fast, m.rope_beta_slow) == ROPE[
        path
    ]
    main, mtp = hf_counts(published)
    with_mtp = abstract_param_count(config)
    config = config.replace(model=config.model.replace(mtp_depth=0))
    assert abstract_param_count(config) == main
    assert with_mtp - main == mtp * published["num_nextn_predict_layers"]
    if path.endswith("deepseek3_671b.py"):  # the report: 671B main model, 11.5B MTP module
        assert round(main / 1e9) == 671 and round(mtp / 1e9, 1) in (11.5, 11.6)


@pytest.mark.slow  # two MLA + MoE steps to compile (MTP, MuonClip): ~25 s each on 2 cores
@pytest.mark.parametrize("path", ["configs/deepseek3_671b.py", "configs/kimi_k2.py"])
def test_tiny_variants_train(path):
    config = load_config(
        path + ":tiny",
        [
            "model.moe.block_size=8",
            "train.batch_size=4",
            "train.seq_len=16",
            "optimizer.warmup_steps=1",
        ],
    )
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    spec = model_spec(config.model, mesh)
    optimizer, schedule = make_optimizer(config.optimizer, 10, spec.param_axes)
    _, shardings = state_shardings(mesh, spec, optimizer)
    state = init_state(config.model, 0, optimizer, shardings, mesh)
    batch = synthetic_batches(config, 1)[0]
    losses = []
    with jax.set_mesh(mesh):
        step = jit_train_step(
            step_fns(config.train, config.optimizer, config.model, spec, optimizer, schedule),
            shardings,
            None,
        )
        for _ in range(4):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    if config.model.mtp_depth:
        assert np.isfinite(float(metrics["mtp_loss"]))
    if config.optimizer.qk_clip:
        assert float(metrics["max_attention_logit"]) > 0
