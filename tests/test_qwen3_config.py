"""configs/qwen3_30b_a3b.py has Qwen3-30B-A3B's sizes: the same parameter count as
transformers' Qwen3MoeForCausalLM built from the checkpoint's config.json values (on the
meta device: nothing allocated), and its `:tiny` variant is the same design at test size,
whose sharded step compiles for a TPU slice with experts split over chips."""

import pytest

from jaxmoe.aot.compile_check import compile_for_topology
from jaxmoe.config.loading import load_config
from tests.helpers import abstract_param_count, compile_cache_off

CONFIG = "configs/qwen3_30b_a3b.py"
# Qwen/Qwen3-30B-A3B's config.json (the values that size or shape the model).
QWEN3_30B_A3B = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "tie_word_embeddings": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
}


def _hf_count(hf: dict) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = dict(hf)
    rope_theta = hf.pop("rope_theta")
    config = transformers.Qwen3MoeConfig(**hf)
    config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def _as_hf(config) -> dict:
    """The config.json a jaxmoe model config stands for (written out by hand here)."""
    m = config.model
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "moe_intermediate_size": m.moe.ffn_dim,
        "intermediate_size": m.ffn_dim,
        "num_experts": m.moe.num_experts,
        "num_experts_per_tok": m.moe.gate.top_k,
        "norm_topk_prob": m.moe.gate.renormalize,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "tie_word_embeddings": m.tie_embeddings,
        "decoder_sparse_step": m.moe.every,
        "mlp_only_layers": [int(i) for i in m.moe.dense_layers.split(",") if i],
        "router_aux_loss_coef": m.moe.balance_loss_weight,
    }


def test_full_config_is_qwen3_30b_a3b():
    config = load_config(CONFIG)
    assert _as_hf(config) == QWEN3_30B_A3B
    m = config.model
    assert (m.qk_norm, m.activation, m.moe.gate.gating, m.moe.router.router_scoring) == (
        "head", "silu", "topk", "softmax",
    )  # fmt: skip
    assert m.moe.num_shared_experts == 0 and m.moe.z_loss_weight == 0.0
    # 30.5B parameters, as the model card says; transformers counts the same.
    count = abstract_param_count(config)
    assert count == _hf_count(QWEN3_30B_A3B) == 30_532_122_624
    # The step of issue 27: 128 x 4096 tokens, no micro-batches, fsdp 4 x expert 8 on 32.
    t = config.train
    assert (t.batch_size, t.seq_len, t.grad_accum) == (128, 4096, 1)
    assert (m.dtype, m.remat, config.optimizer.name, config.mesh.expert) == (
        "bfloat16", "full", "adamw", 8,
    )  # fmt: skip


@pytest.mark.slow  # a TPU compile of the sharded step: ~40 s quiet
def test_tiny_variant_is_the_same_design_and_compiles_with_expert_parallelism():
    config = load_config(f"{CONFIG}:tiny")
    full = _as_hf(load_config(CONFIG))
    tiny = _as_hf(config)
    same = ("norm_topk_prob", "tie_word_embeddings", "decoder_sparse_step", "mlp_only_layers")
    assert {k: tiny[k] for k in same} == {k: full[k] for k in same}
    assert tiny["num_experts"] > tiny["num_experts_per_tok"] > 2  # fine-grained top-k
    assert config.model.qk_norm == "head"
    assert abstract_param_count(config) == _hf_count(tiny)
    overrides = ["mesh.expert=4", "model.dtype=bfloat16"]
    config = load_config(f"{CONFIG}:tiny", overrides)
    with compile_cache_off():
        report = compile_for_topology(config, "v5p-8")
    assert report["verdict"] == "fits"
    assert report["mesh"]["expert"] == 4


def test_pod_compile_peer_case_is_the_issues_maxtext_command(monkeypatch, capsys):
    """MaxText's settings are issue 27's train_compile line word for word, and --systems
    compiles only the rows asked for (both in one process each, stubbed here)."""
    from benchmarks import pod_compile_peer as bench

    case = bench.CASES["qwen3_30b_a3b"]
    issue = str.split(
        "model_name=qwen3-30b-a3b compile_topology=v5p-64 per_device_batch_size=4 "
        "max_target_length=4096 ici_fsdp_parallelism=4 ici_expert_parallelism=8 "
        "remat_policy=full sparse_matmul=true megablox=true dtype=bfloat16 weight_dtype=float32"
    )
    assert sorted([f"compile_topology={case['topology']}", *case["maxtext"]]) == sorted(issue)
    assert case["jaxmoe"] == [CONFIG]
    calls = []
    stats = {"peak_hbm_bytes": 2, "wall_s": 3.0, "cpu_s": 3.0, "load_before": 0.0,
             "load_after": 0.0}  # fmt: skip
    monkeypatch.setattr(bench, "venv_python", lambda venv: "/venv/bin/python")
    monkeypatch.setattr(bench, "compiler_versions", lambda python, gpu=False: {"jax": "x"})
    monkeypatch.setattr(bench, "run_maxtext", lambda venv, case: calls.append("mt") or stats)
    monkeypatch.setattr(
        bench, "run_jaxmoe", lambda case, python=None: calls.append(python) or {**stats}
    )
    argv = ["--cases", "qwen3_30b_a3b", "--systems", "maxtext", "jaxmoe@maxtext_env"]
    assert bench.main(argv) == 0
    assert calls == ["mt", "/venv/bin/python"]  # MaxText, then jaxmoe by its interpreter
    assert "| qwen3_30b_a3b | | jaxmoe / MaxText | 1.00x |" in capsys.readouterr().out
