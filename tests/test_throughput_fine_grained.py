"""train_throughput's fine-grained variant: the tiny Qwen3-MoE against transformers'
Qwen3MoeForCausalLM (parameter count from HF's own classes, and a shrunk run end to end)."""

import json

import pytest

from benchmarks import throughput_hf, throughput_jaxmoe, train_throughput
from tests.helpers import abstract_param_count

SHRINK = [
    f"--set={item}"
    for item in (
        "model.vocab_size=128",
        "model.d_model=32",
        "model.num_layers=1",
        "model.num_heads=4",
        "model.head_dim=8",
        "model.moe.num_experts=16",
        "model.moe.ffn_dim=8",
        "train.seq_len=16",
        "train.batch_size=2",
    )
]


def test_fine_grained_is_a_tiny_qwen3_moe_of_hugging_faces_size():
    pytest.importorskip("transformers")
    config = throughput_jaxmoe.variant_config("fine_grained", [])
    moe = config.model.moe
    assert (moe.num_experts, moe.ffn_dim, moe.gate.gating, moe.gate.top_k) == (64, 128, "topk", 8)
    assert moe.gate.renormalize and config.model.qk_norm == "head"
    # Hand count: untied embeddings 2 x 8192 x 256; per layer q/out 2 x 256 x 256, k/v
    # 2 x 256 x 64, two norms 2 x 256, q/k norms 2 x 32, router 256 x 64, experts
    # 64 x 3 x 256 x 128; the final norm 256.
    per_layer = 2 * 256 * 256 + 2 * 256 * 64 + 2 * 256 + 2 * 32 + 256 * 64 + 64 * 3 * 256 * 128
    expected = 2 * 8192 * 256 + 4 * per_layer + 256
    assert abstract_param_count(config) == expected == 30_083_584
    spec = throughput_jaxmoe.peer_spec(config)
    runner = throughput_hf.HFRunner(spec, "fine_grained", num_batches=1, threads=1)
    assert runner.num_params() == expected


@pytest.mark.slow  # two workers and two compiles: minutes on a loaded host
def test_fine_grained_runs_against_hf_end_to_end(capsys):
    pytest.importorskip("transformers")
    argv = ["--variants", "fine_grained", "--peer", "hf", "--steps", "2", "--warmup", "1"]
    argv += ["--blocks", "2", "--threads", "1", "--json", "-", *SHRINK]
    assert train_throughput.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    systems = {(r["variant"], r["system"]) for r in result["rows"]}
    assert systems == {("fine_grained", "jaxmoe"), ("fine_grained", "hf")}
    ratio = result["ratios"]["jaxmoe_fine_grained/hf_fine_grained"]
    assert ratio["blocks"] == 2 and ratio["min"] <= ratio["ratio"] <= ratio["max"]
    assert result["imported"]["hf_fine_grained"] == ["torch"]
