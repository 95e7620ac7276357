"""The throughput benchmark end to end (tiny shapes, no peer) and the tiny Mixtral's size."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxmoe.config.loading import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_mixtral.py"


def _bench_module(name: str = "train_throughput"):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _param_count(variant: str) -> int:
    import jax

    from jaxmoe.models.spec import model_spec
    from jaxmoe.parallel.mesh import make_mesh

    config = load_config(f"{CONFIG}:{variant}")
    mesh = make_mesh(config.mesh, devices=jax.devices()[:1])
    spec = model_spec(config.model, mesh)  # eval_shape only: nothing is allocated
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(spec.abstract_params))


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
    assert _param_count(variant) == expected
    assert _expected_count(8 * 3 * 256 * 512, 256 * 8) == 17_443_072
    assert _expected_count(3 * 256 * 1024, 0) == 7_997_696


def test_tiny_mixtral_matches_hugging_face_mixtral_size():
    """Hugging Face's own count for the same sizes (an independent reference)."""
    pytest.importorskip("transformers")
    spec = _bench_module("throughput_jaxmoe").peer_spec(load_config(f"{CONFIG}:top2"))
    runner = _bench_module("throughput_hf").HFRunner(spec, "top2", num_batches=1, threads=1)
    assert runner.num_params() == _param_count("top2")


def test_workers_never_import_the_other_system():
    """Each side of the comparison lives in its own process with only its own framework."""
    probe = (
        "import sys, runpy; sys.argv = [sys.argv[1], '--help']\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print(sorted(m for m in ('jax', 'torch') if m in sys.modules))"
    )
    seen = {}
    for name in ("throughput_hf", "throughput_jaxmoe", "train_throughput"):
        result = subprocess.run(
            [sys.executable, "-c", probe, str(ROOT / "benchmarks" / f"{name}.py")],
            capture_output=True,
            text=True,
            check=True,
        )
        seen[name] = result.stdout.strip().splitlines()[-1]
    # The HF worker imports torch lazily, in its runner: at start-up it holds neither.
    assert seen == {"throughput_hf": "[]", "throughput_jaxmoe": "['jax']", "train_throughput": "[]"}


def test_unknown_variant_is_a_one_line_error():
    with pytest.raises(Exception, match="unknown variant 'top3'"):
        load_config(f"{CONFIG}:top3")


def test_benchmark_runs_end_to_end_and_prints_json(capsys):
    bench = _bench_module()
    shrink = [
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
    ]
    argv = ["--variants", "adaptive", "--steps", "2", "--warmup", "1", "--blocks", "2"]
    argv += ["--json", *[f"--set={item}" for item in shrink]]
    assert bench.main(argv) == 0
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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
