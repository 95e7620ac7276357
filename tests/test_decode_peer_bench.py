"""The decode peer benchmark end to end at tiny sizes: both systems in their own processes,
every case timed, ratios and the adaptive/top-2 comparison reported."""

import json
import math

import pytest

from benchmarks import decode_peer as bench


def test_decode_peer_benchmark_runs_both_systems(capsys, monkeypatch):
    pytest.importorskip("transformers")
    tiny = {
        "vocab": 256, "d_model": 32, "layers": 1, "heads": 4, "head_dim": 8, "ffn": 64,
        "rope_theta": 10000.0, "max_len": 64, "experts": 4, "threshold": 0.1,
    }  # fmt: skip
    monkeypatch.setattr(bench, "SPEC", tiny)
    # 4 query heads: "GQA-8" is 2 groups
    monkeypatch.setattr(bench, "KV_HEADS", {"MHA": 4, "GQA-8": 2, "MQA": 1})
    argv = ["--peer", "hf", "--batches", "1", "--prompt_len", "8", "--new_tokens", "3"]
    assert bench.main([*argv, "--rounds", "1", "--json", "-"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    systems = {(r["system"], r["kv_heads"], r.get("gating", "")) for r in result["rows"]}
    for kv in (4, 2, 1):
        assert {("jaxmoe", kv, ""), ("hf", kv, "")} <= systems
    assert ("jaxmoe", 2, "adaptive") in systems and ("hf", 2, "top2") in systems
    # Timings at these sizes are noise (never asserted); each case must report one.
    assert all(math.isfinite(r["ms_per_token"]) for r in result["rows"])
    assert set(result["jaxmoe_over_hf_ms_per_token"]) >= {"MHA batch 1", "MQA batch 1"}
    assert math.isfinite(result["adaptive_over_top2"]) and isinstance(result["quiet"], bool)
