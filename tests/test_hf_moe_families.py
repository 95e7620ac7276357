"""Qwen3-MoE, Qwen2-MoE and OLMoE: `convert hf` and `export hf` against transformers' models.

The reference is transformers (PyTorch): tiny random models of each family, built with its
own classes and saved with `save_pretrained`, covering dense layers among the MoE ones
(mlp_only_layers, decoder_sparse_step), norm_topk_prob on and off, Qwen2-MoE's gated shared
expert, Qwen3-MoE's per-head and OLMoE's whole-projection q/k norms, and tied embeddings.
The converted jaxmoe model must give the same per-example NLL (1e-4 relative) and logits;
the export must load with transformers' own class (no remote code) and give them again.
Routers are drawn at 3x unit scale so that flipping norm_topk_prob moves the logits 100x
beyond the tolerance (checked: the test can see a wrong mapping).
"""

import json
import shutil

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from jaxmoe.checkpoints.manager import save_params
from jaxmoe.config.stored import read_config
from jaxmoe.conversions.hf.export_config import export_plan
from jaxmoe.conversions.hf.exporter import export_hf
from jaxmoe.conversions.hf.importer import convert_hf
from tests.helpers import tiny_config, unit_scale_params
from tests.test_data_sources import build_bpe
from tests.test_hf import (
    IDS,
    TOL,
    assert_close,
    hf_logits,
    jaxmoe_logits,
    load_converted,
    one_line_error,
    randomize,
)

REL_TOL = 1e-4
ROUTER_SCALE = 3.0


def nll_per_example(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Mean next-token negative log-likelihood of each row of `ids` [B, L] (float64)."""
    x = logits[:, :-1].astype(np.float64)
    logz = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    picked = np.take_along_axis(x, ids[:, 1:, None], -1)[..., 0]
    return (logz - picked).mean(-1)


def assert_same_nll(got_logits, want_logits, ids=IDS) -> np.ndarray:
    got, want = nll_per_example(got_logits, ids), nll_per_example(want_logits, ids)
    np.testing.assert_allclose(got, want, rtol=REL_TOL, atol=0)
    assert_close(got_logits, want_logits)
    return np.abs(got / want - 1)


def build(model_class, config, seed: int):
    """A transformers model at unit-scale random weights, routers scaled up."""
    model = randomize(model_class(config), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
    return model


def flipped_norm_logits(model, ids=IDS) -> np.ndarray:
    """Logits of the same weights with norm_topk_prob flipped: what a wrong mapping gives."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.norm_topk_prob = not model.config.norm_topk_prob
    other = type(model)(config).eval()
    other.load_state_dict(model.state_dict())
    return hf_logits(other, ids)


def check_family(model, src, tmp_path, architecture: str, ids=IDS):
    """convert -> same NLL; export -> transformers' own class, same NLL again."""
    want = hf_logits(model, ids)
    assert np.abs(flipped_norm_logits(model, ids) - want).max() > 100 * TOL
    convert_hf(str(src), str(tmp_path / "ckpt"))
    converted = assert_same_nll(jaxmoe_logits(load_converted(tmp_path / "ckpt"), ids), want)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert "auto_map" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(reloaded).__name__ == architecture
    exported = assert_same_nll(hf_logits(reloaded, ids), want, ids)
    return read_config(str(tmp_path / "ckpt")), converted.max(), exported.max()


# ----------------------------------------------------------------------------- Qwen3-MoE


def qwen3_moe(
    norm: bool, tie: bool, seed: int, k: int = 2, dense: tuple = (1,)
) -> Qwen3MoeForCausalLM:
    """3 layers, `dense` of them dense (mlp_only_layers); head_dim 16 != d / heads; 8
    experts top-k."""
    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=k, moe_intermediate_size=24, mlp_only_layers=list(dense),
        norm_topk_prob=norm, tie_word_embeddings=tie, rms_norm_eps=1e-5, rope_theta=500.0,
        router_aux_loss_coef=0.02,
    )  # fmt: skip
    return build(Qwen3MoeForCausalLM, config, seed)


@pytest.mark.parametrize(
    ("norm", "tie", "k"), [(True, False, 2), (False, True, 2), (False, False, 1)]
)
def test_qwen3_moe_converts_and_exports(norm, tie, k, tmp_path):
    """k = 1: one expert weighted by its probability (raw) or by 1 (norm_topk_prob)."""
    model = qwen3_moe(norm, tie, seed=31, k=k)
    model.save_pretrained(tmp_path / "src")
    config, *_ = check_family(model, tmp_path / "src", tmp_path, "Qwen3MoeForCausalLM")
    m = config.model
    assert (m.qk_norm, m.head_dim, m.tie_embeddings, m.qkv_bias) == ("head", 16, tie, False)
    assert (m.moe.num_experts, m.moe.gate.top_k, m.moe.gate.renormalize) == (8, k, norm)
    assert (m.moe.ffn_dim, m.moe.dense_layers, m.moe.balance_loss_weight) == (24, "1", 0.02)
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["mlp_only_layers"] == [1] and exported["norm_topk_prob"] is norm


# ----------------------------------------------------------------------------- Qwen2-MoE


def test_regating_a_top4_qwen3_moe_keeps_up_to_its_4_experts(tmp_path):
    """`convert hf --config.model.moe.gating=adaptive_k` on a top-4 model: max_k becomes the
    checkpoint's 4 (not the key's default 2) unless given; with a threshold no gap reaches,
    every token keeps its 4 experts, so the re-gated model gives transformers' top-4 NLL."""
    model = qwen3_moe(norm=True, tie=False, seed=33, k=4)
    model.save_pretrained(tmp_path / "src")
    always = ("model.moe.gating=adaptive_k", "model.moe.threshold=10.0")
    config = convert_hf(str(tmp_path / "src"), str(tmp_path / "regated"), overrides=always)
    assert (config.model.moe.gate.gating, config.model.moe.gate.max_k) == ("adaptive_k", 4)
    got = jaxmoe_logits(load_converted(tmp_path / "regated"), IDS)
    assert_same_nll(got, hf_logits(model, IDS))
    own = ("model.moe.gating=adaptive_k", "model.moe.max_k=3")
    config = convert_hf(str(tmp_path / "src"), str(tmp_path / "own"), overrides=own)
    assert config.model.moe.gate.max_k == 3


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """4 layers, MoE in layers 1 and 3 (decoder_sparse_step 2), 8 experts top-4, a gated
    shared expert; saved with a BPE tokenizer (vocab 400) beside it."""
    config = Qwen2MoeConfig(
        vocab_size=400, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=4,
        moe_intermediate_size=16, shared_expert_intermediate_size=40, decoder_sparse_step=2,
        norm_topk_prob=False, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1,
        pad_token_id=0,
    )  # fmt: skip
    model = build(Qwen2MoeForCausalLM, config, seed=32)
    src = tmp_path_factory.mktemp("hf_qwen2_moe")
    build_bpe(src, {"eos_token": "</s>", "bos_token": "<s>", "pad_token": "<pad>",
                    "tokenizer_class": "PreTrainedTokenizerFast"})  # fmt: skip
    model.save_pretrained(src)
    return model, src


def test_qwen2_moe_shared_expert_and_tokenizer(qwen2_moe, tmp_path):
    model, src = qwen2_moe
    config, *_ = check_family(model, src, tmp_path, "Qwen2MoeForCausalLM")
    m = config.model
    assert (m.qk_norm, m.qkv_bias, m.moe.every, m.moe.gate.top_k) == ("none", True, 2, 4)
    assert (m.moe.num_shared_experts, m.moe.shared_ffn_dim, m.moe.shared_expert_gate) == (
        1, 40, True,
    )  # fmt: skip
    # The tokenizer travels both ways, as Llama's does.
    assert (tmp_path / "ckpt" / "tokenizer" / "tokenizer.json").is_file()
    text = "The quick brown fox"
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(text).input_ids == (
        AutoTokenizer.from_pretrained(src)(text).input_ids
    )


def test_qwen2_moe_fused_in_memory_names(qwen2_moe, tmp_path):
    """transformers 5.x in-memory names (mlp.experts.gate_up_proj [E, 2F, D]) also read."""
    model, src = qwen2_moe
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert state["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 32, 32)
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", fused / "config.json")
    convert_hf(str(fused), str(tmp_path / "ckpt"))
    assert_same_nll(jaxmoe_logits(load_converted(tmp_path / "ckpt"), IDS), hf_logits(model, IDS))


def test_qwen2_moe_scanned_layers(qwen2_moe, tmp_path):
    """MoE every 2nd layer repeats: `scan_layers` converts (stacked by period) and exports."""
    model, src = qwen2_moe
    want = hf_logits(model, IDS)
    convert_hf(str(src), str(tmp_path / "ckpt"), overrides=["--config.model.scan_layers=True"])
    assert read_config(str(tmp_path / "ckpt")).model.scan_layers
    assert_same_nll(jaxmoe_logits(load_converted(tmp_path / "ckpt"), IDS), want)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert_same_nll(hf_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "hf"), IDS), want)


def test_qwen3_moe_dense_prefix_scans(tmp_path):
    """mlp_only_layers = [0]: layer 0 unrolled ahead of the scanned MoE layers 1-2
    (models/stack.py's head); converts to transformers' NLL and exports back."""
    model = qwen3_moe(norm=True, tie=False, seed=37, dense=(0,))
    model.save_pretrained(tmp_path / "src")
    want = hf_logits(model, IDS)
    convert_hf(
        str(tmp_path / "src"), str(tmp_path / "ckpt"), overrides=["--config.model.scan_layers=True"]
    )
    assert '"head"' in (tmp_path / "ckpt" / "params" / "_METADATA").read_text()
    assert_same_nll(jaxmoe_logits(load_converted(tmp_path / "ckpt"), IDS), want)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["mlp_only_layers"] == [0]
    assert_same_nll(hf_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "hf"), IDS), want)


def test_irregular_dense_layers_refuse_scan_layers(tmp_path):
    qwen3_moe(norm=True, tie=False, seed=36).save_pretrained(tmp_path / "src")
    scan = ["--config.model.scan_layers=True"]
    src, dst = str(tmp_path / "src"), str(tmp_path / "out")
    message = one_line_error(convert_hf, src, dst, "float32", scan)
    assert "scan_layers" in message and "layer 1" in message


# ----------------------------------------------------------------------------- OLMoE


@pytest.mark.parametrize("norm", [False, True])
def test_olmoe_converts_and_exports(norm, tmp_path):
    """2 layers, MoE in both, 8 experts top-4; q/k norms over the whole projections."""
    config = OlmoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=4,
        norm_topk_prob=norm, rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = build(OlmoeForCausalLM, config, seed=33)
    model.save_pretrained(tmp_path / "src")
    config, *_ = check_family(model, tmp_path / "src", tmp_path, "OlmoeForCausalLM")
    m = config.model
    assert (m.qk_norm, m.moe.ffn_dim, m.moe.every, m.moe.gate.renormalize) == (
        "projection", 24, 1, norm,
    )  # fmt: skip


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("family", "field"),
    [
        ("olmoe", {"clip_qkv": 8.0}),
        ("qwen3_moe", {"attention_bias": True}),
        ("qwen3_moe", {"mlp_only_layers": [1, 7]}),
        ("qwen2_moe", {"sliding_window": 4, "use_sliding_window": True}),
    ],
)
def test_unrepresentable_field_refused_in_one_line(family, field, tmp_path):
    model = qwen3_moe(norm=True, tie=False, seed=34)
    model.save_pretrained(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config |= {"model_type": family} | field
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    message = one_line_error(convert_hf, str(tmp_path / "src"), str(tmp_path / "out"))
    assert next(iter(field)) in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (("model.qk_norm=head", "model.moe.gating=adaptive"), "model.moe.gating='adaptive'"),
        (
            ("model.qk_norm=projection", "model.moe.gating=top2", "model.moe.every=2"),
            "OLMoE is MoE in every layer",
        ),
        (("model.moe.num_shared_experts=1", "model.moe.gating=top2"), "shared_expert_gate"),
        (
            ("model.qk_norm=head", "model.moe.gating=top2", "model.moe.router_scoring=sigmoid"),
            "model.moe.router_scoring='sigmoid'",
        ),
        (("model.moe.dense_layers=0", "model.moe.gating=top2"), "dense layers [0]"),
        (("model.qk_norm=head", "model.moe.num_experts=0"), "model.qk_norm='head'"),
        (("model.moe.gating=adaptive_k",), "model.moe.gating='adaptive_k'"),
    ],
)
def test_export_refuses_what_the_families_cannot_express(overrides, reason):
    message = one_line_error(export_plan, tiny_config(*overrides).model)
    assert "not expressible" in message and reason in message


def test_jaxmoe_shared_experts_export_as_one_qwen2_moe_shared_expert(tmp_path):
    """Two shared experts of width 8 are one HF shared expert of width 16; layer 0 dense."""
    config = tiny_config(
        "model.vocab_size=64", "model.num_layers=3", "model.moe.dense_layers=0",
        "model.moe.gating=topk", "model.moe.top_k=3", "model.moe.renormalize=False",
        "model.moe.num_shared_experts=2", "model.moe.shared_ffn_dim=8",
        "model.moe.shared_expert_gate=True", "model.qkv_bias=True", "model.norm_eps=1e-5",
    )  # fmt: skip
    params = jax.tree_util.tree_map_with_path(  # routers x3, as for the HF models above
        lambda path, a: a * ROUTER_SCALE if path[-1].key == "router" else a,
        unit_scale_params(config.model, seed=35),
    )
    save_params(str(tmp_path / "ckpt"), params, config)
    hf = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert (hf["shared_expert_intermediate_size"], hf["mlp_only_layers"]) == (16, [0])
    assert (hf["num_experts_per_tok"], hf["norm_topk_prob"], hf["qkv_bias"]) == (3, False, True)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(reloaded).__name__ == "Qwen2MoeForCausalLM"
    want = jaxmoe_logits(load_converted(config.model, params), IDS)
    assert_same_nll(hf_logits(reloaded, IDS), want)
