"""The throughput benchmark end to end (tiny shapes; MaxText's peer where its venv exists)
and the tiny Mixtral's size."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import throughput_hf, throughput_jaxmoe, throughput_maxtext, train_throughput
from jaxmoe.config.loading import load_config
from tests.helpers import abstract_param_count

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_mixtral.py"
MAXTEXT_PYTHON = Path("~/.cache/maxtext_venv/bin/python").expanduser()
# The tiny Mixtral shrunk so that a compile takes seconds (jaxmoe's --set overrides; the
# peers get the same sizes from jaxmoe's peer_spec).
SHRINK = [
    f"--set={item}"
    for item in (
        "model.vocab_size=128",
        "model.d_model=32",
        "model.num_layers=1",
        "model.num_heads=4",
        "model.head_dim=8",
        "model.ffn_dim=64",
        "model.moe.ffn_dim=32",
        "model.moe.block_size=32",
        "train.seq_len=16",
        "train.batch_size=2",
    )
]


def _expected_count(ffn_params_per_layer: int, router: int) -> int:
    vocab, dim, layers, heads, kv_heads, head_dim = 8192, 256, 4, 8, 2, 32
    embeddings = 2 * vocab * dim  # untied input embedding and output layer
    attention = 2 * dim * heads * head_dim + 2 * dim * kv_heads * head_dim  # q, out; k, v
    norms = 2 * dim
    per_layer = attention + norms + router + ffn_params_per_layer
    return embeddings + layers * per_layer + dim  # + the final norm


@pytest.mark.parametrize(
    "variant, expected",
    [
        # 8 experts x (wi_0, wi_1, wo) of 256 x 512, a 256 x 8 router: Mixtral's 17,443,072.
        ("top2", _expected_count(8 * 3 * 256 * 512, 256 * 8)),
        ("adaptive", 17_443_072),
        # One SwiGLU FFN of 1024 per layer, no router: Llama's 7,997,696.
        ("dense", _expected_count(3 * 256 * 1024, 0)),
    ],
)
def test_tiny_mixtral_has_the_peer_parameter_count(variant, expected):
    assert abstract_param_count(load_config(f"{CONFIG}:{variant}")) == expected
    assert _expected_count(8 * 3 * 256 * 512, 256 * 8) == 17_443_072
    assert _expected_count(3 * 256 * 1024, 0) == 7_997_696


def test_tiny_mixtral_matches_hugging_face_mixtral_size():
    """Hugging Face's own count for the same sizes (an independent reference)."""
    pytest.importorskip("transformers")
    spec = throughput_jaxmoe.peer_spec(load_config(f"{CONFIG}:top2"))
    runner = throughput_hf.HFRunner(spec, "top2", num_batches=1, threads=1)
    assert runner.num_params() == abstract_param_count(load_config(f"{CONFIG}:top2"))


def test_workers_never_import_the_other_system():
    """Each side of the comparison lives in its own process with only its own framework."""
    probe = (
        "import sys, runpy; name = sys.argv[1]; sys.argv = [name, '--help']\n"
        "try:\n    runpy.run_module(f'benchmarks.{name}', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print(sorted(m for m in ('jax', 'torch') if m in sys.modules))"
    )
    seen = {}
    for name in ("throughput_hf", "throughput_jaxmoe", "throughput_maxtext", "train_throughput"):
        command = [sys.executable, "-c", probe, name]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
        seen[name] = result.stdout.strip().splitlines()[-1]
    # The HF and MaxText workers import their framework lazily, in their runners.
    assert seen == {
        "throughput_hf": "[]",
        "throughput_jaxmoe": "['jax']",
        "throughput_maxtext": "[]",
        "train_throughput": "[]",
    }


def test_unknown_variant_is_a_one_line_error():
    with pytest.raises(Exception, match="unknown variant 'top3'"):
        load_config(f"{CONFIG}:top3")


def test_benchmark_runs_end_to_end_and_prints_json(capsys):
    argv = ["--variants", "adaptive", "--steps", "2", "--warmup", "1", "--blocks", "2"]
    argv += ["--json", "-", *SHRINK]
    assert train_throughput.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) >= {"rows", "ratios", "load_average_1min", "quiet"}
    assert isinstance(result["quiet"], bool) and len(result["load_average_1min"]["during"]) == 2
    assert result["ratios"] == {}  # no peer ran
    rows = {(r["variant"], r["system"]): r for r in result["rows"]}
    assert set(rows) == {("adaptive", "jaxmoe")}  # one compile keeps the test short
    adaptive = rows[("adaptive", "jaxmoe")]
    assert adaptive["steps"] == 2
    assert adaptive["tokens_per_s"] > 0
    np.testing.assert_allclose(adaptive["tokens_per_s"] * adaptive["step_time_s"], 2 * 16)
    np.testing.assert_allclose(
        adaptive["flops_per_s"], adaptive["flops_per_token"] * adaptive["tokens_per_s"]
    )
    # Hand count per token of the shrunk top-2 model (multiply-adds x 2 x 3 for fwd + bwd):
    # q, out 2 * 32 * (4 x 8); k, v 2 * 32 * (2 x 8); router 32 * 8; experts 2 * 3 * 32 * 32;
    # scores (QK^T and PV) 2 * 4 heads * 8 * 16 keys; output layer 32 * 128.
    macs = 2 * 32 * 32 + 2 * 32 * 16 + 32 * 8 + 2 * 3 * 32 * 32 + 2 * 4 * 8 * 16 + 32 * 128
    # Adaptive is counted at its measured top-2 share, between top-1 and top-2 costs.
    share = adaptive["top2_fraction"]
    assert 0.0 <= share <= 1.0
    one_expert = 6 * (macs - 3 * 32 * 32)
    assert adaptive["flops_per_token"] == pytest.approx(one_expert + share * 6 * 3 * 32 * 32)


def test_maxtext_overrides_describe_the_tiny_mixtral():
    """The base.yml keys MaxText's worker builds the peer from (sizes from the config)."""
    spec = throughput_jaxmoe.peer_spec(load_config(f"{CONFIG}:top2"))
    maxtext = throughput_maxtext
    top2 = maxtext.maxtext_overrides(spec, "top2")
    expected = {
        "decoder_block": "mixtral",
        "vocab_size": 8192,
        "base_emb_dim": 256,
        "base_num_decoder_layers": 4,
        "base_num_query_heads": 8,
        "base_num_kv_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "base_moe_mlp_dim": 512,
        "capacity_factor": -1.0,
        "load_balance_loss_weight": 0.01,
        "max_target_length": 256,
        "per_device_batch_size": 8,
        "dtype": "float32",
        "logits_via_embedding": False,
        "rope_max_timescale": 10000,
        "adam_b1": 0.9,
        "adam_b2": 0.95,
        "adam_eps": 1e-8,
        "adam_weight_decay": 0.1,
        "gradient_clipping_threshold": 1.0,
        "sparse_matmul": True,
        "megablox": False,
    }
    assert {k: top2[k] for k in expected} == expected
    assert maxtext.maxtext_overrides(spec, "top1")["num_experts_per_tok"] == 1
    dense = maxtext.maxtext_overrides(spec, "dense")
    assert dense["decoder_block"] == "llama2" and dense["base_mlp_dim"] == 1024
    assert "num_experts" not in dense


def test_missing_maxtext_venv_is_one_line_and_jaxmoe_still_runs(capsys, tmp_path):
    absent = tmp_path / "no_venv"
    argv = ["--variants", "adaptive", "--peer", "maxtext", "--maxtext_venv", str(absent)]
    argv += ["--steps", "1", "--warmup", "1", "--blocks", "1", "--json", "-", *SHRINK]
    assert train_throughput.main(argv) == 0
    out, err = capsys.readouterr()
    skip_lines = [line for line in err.splitlines() if "MaxText" in line]
    assert len(skip_lines) == 1 and str(absent) in skip_lines[0]
    result = json.loads(out.strip().splitlines()[-1])
    assert [(r["variant"], r["system"]) for r in result["rows"]] == [("adaptive", "jaxmoe")]
    assert result["rows"][0]["tokens_per_s"] > 0
    assert result["ratios"] == {} and set(result["skipped"]) == {"maxtext"}


@pytest.mark.skipif(not MAXTEXT_PYTHON.exists(), reason="no MaxText venv at ~/.cache/maxtext_venv")
def test_maxtext_peer_trains_the_same_model_in_its_own_process(capsys):
    """MaxText's own train step, in its venv's interpreter, next to jaxmoe's (~40 s)."""
    argv = ["--variants", "top2", "--peer", "maxtext", "--steps", "2", "--warmup", "1"]
    argv += ["--blocks", "2", "--json", "-", *SHRINK]
    assert train_throughput.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # Each worker held only its own framework: MaxText's never jaxmoe nor torch.
    assert result["imported"] == {"jaxmoe_top2": ["jax", "jaxmoe"], "maxtext_top2": ["jax"]}
    rows = {(r["variant"], r["system"]): r for r in result["rows"]}
    maxtext = rows[("top2", "maxtext")]
    # MaxText's own count of the shrunk model, by hand: untied embeddings 2 * 128 * 32,
    # q, out 2 * 32 * 32 and k, v 2 * 32 * 16, two norms, router 32 * 8, 8 experts of
    # 3 * 32 * 32, the final norm.
    assert maxtext["num_params"] == 2 * 128 * 32 + 3072 + 64 + 256 + 8 * 3 * 32 * 32 + 32
    assert maxtext["moe"] == "ragged" and maxtext["steps"] == 2
    assert 0 < maxtext["step_time_s"] < 30  # a 36k-parameter step: milliseconds, not minutes
    np.testing.assert_allclose(maxtext["tokens_per_s"] * maxtext["step_time_s"], 2 * 16)
    ratio = result["ratios"]["jaxmoe_top2/maxtext_top2"]
    assert ratio["blocks"] == 2 and ratio["min"] <= ratio["ratio"] <= ratio["max"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
