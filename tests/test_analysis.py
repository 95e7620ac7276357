"""Router analysis: the host counters on hand-built routing (hand-computed rates, and a naive
per-token loop on random routing), then `jaxmoe analyze-routing` end to end on a tiny
random-initialised checkpoint restored onto an expert-parallel mesh, checked against the
training metric `top2_fraction` that the MoE layer itself reports."""

import contextlib
import io
import json
from collections import defaultdict

import jax
import numpy as np
import pytest
from flax import nnx

from jaxmoe.checkpoints.manager import save_params
from jaxmoe.cli import build_parser
from jaxmoe.inference import routing_analysis as analysis
from jaxmoe.inference import routing_probe as analysis_probe
from jaxmoe.inference.routing_counts import (
    RoutingCounts,
    frequency_bucket_edges,
    position_bucket_edges,
    summarize,
)
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params
from jaxmoe.training.steps import forward
from tests.helpers import tiny_config

# Two batches of a decoder-only model with two MoE layers (worked through by hand below).
TOKENS_A = [[1, 2, 1, 3], [2, 2, 4, 0]]
VALID_A = [[1, 1, 1, 1], [1, 1, 1, 0]]
TOP2_A = [[[1, 0, 0, 1], [0, 1, 1, 1]], [[0, 0, 1, 1], [0, 0, 0, 0]]]  # [layer, B, L]
TOKENS_B = [[5, 1, 2, 2, 2, 1]]
VALID_B = [[1, 1, 1, 1, 1, 1]]
TOP2_B = [[[1, 1, 1, 1, 0, 0]], [[1, 0, 0, 0, 0, 1]]]


@pytest.fixture
def hand_counts():
    counts = RoutingCounts(["layer_0", "layer_1"], ["decoder", "decoder"], vocab_size=8)
    counts.add("decoder", np.array(TOKENS_A), np.array(VALID_A, bool), np.array(TOP2_A, bool))
    counts.add("decoder", np.array(TOKENS_B), np.array(VALID_B, bool), np.array(TOP2_B, bool))
    return counts


def test_hand_example_per_layer_and_stack(hand_counts):
    # 13 valid tokens; layer 0 sent 8 of them to two experts, layer 1 sent 4.
    summary = summarize(hand_counts, min_count=4, base=2)
    assert [(r["layer"], r["tokens"], r["top2"]) for r in summary["layers"]] == [
        ("layer_0", 13, 8),
        ("layer_1", 13, 4),
    ]
    assert summary["layers"][0]["top2_rate"] == pytest.approx(8 / 13)
    decoder = summary["stacks"]["decoder"]
    assert decoder["tokens"] == 13 and decoder["distinct_ids"] == 5
    assert decoder["top2_rate"] == pytest.approx(6 / 13)  # mean of 8/13 and 4/13


def test_hand_example_frequency_buckets(hand_counts):
    # Counts: id1 4, id2 6, id3 1, id4 1, id5 1. Base 2: buckets 1, 2-3, 4-7.
    rows = summarize(hand_counts, base=2)["stacks"]["decoder"]["by_frequency"]
    assert [(r["bucket"], r["token_ids"], r["tokens"]) for r in rows] == [
        ("1", 3, 3),
        ("2-3", 0, 0),
        ("4-7", 2, 10),
    ]
    assert rows[0]["top2_rate_per_layer"] == pytest.approx({"layer_0": 1.0, "layer_1": 2 / 3})
    assert rows[0]["top2_rate"] == pytest.approx(5 / 6)
    assert rows[1]["top2_rate"] is None
    assert rows[2]["top2_rate_per_layer"] == pytest.approx({"layer_0": 0.5, "layer_1": 0.2})
    assert rows[2]["top2_rate"] == pytest.approx(0.35)


def test_hand_example_position_buckets(hand_counts):
    # Tokens per position 0..5: 3 3 3 2 1 1; layer 0 top-2: 2 2 2 2 0 0; layer 1: 1 0 1 1 0 1.
    rows = summarize(hand_counts)["stacks"]["decoder"]["by_position"]
    assert [(r["bucket"], r["tokens"]) for r in rows] == [
        ("0", 3),
        ("1", 3),
        ("2-3", 5),
        ("4-5", 2),
    ]
    assert [r["top2_rate"] for r in rows] == pytest.approx([0.5, 1 / 3, 0.6, 0.25])
    assert rows[2]["top2_rate_per_layer"] == pytest.approx({"layer_0": 0.8, "layer_1": 0.4})


def test_hand_example_pieces(hand_counts):
    # Rates (both layers pooled): id1 4/8, id2 3/12, id3 2/2, id4 1/2, id5 2/2.
    names = {1: "a", 2: "b", 3: "c", 4: "d", 5: "e"}
    frequent = summarize(hand_counts, names.get, min_count=4)["stacks"]["decoder"]
    assert frequent["eligible_ids"] == 2
    assert [(p["id"], p["piece"], p["count"]) for p in frequent["highest"]] == [
        (1, "a", 4),
        (2, "b", 6),
    ]
    assert [p["top2_rate"] for p in frequent["highest"]] == pytest.approx([0.5, 0.25])
    assert frequent["highest"][1]["top2_rate_per_layer"] == pytest.approx(
        {"layer_0": 0.5, "layer_1": 0.0}
    )
    assert [p["id"] for p in frequent["lowest"]] == [2, 1]
    # Ties: equal rates rank the more frequent id first, then the lower id.
    every = summarize(hand_counts, min_count=1, top_n=2)["stacks"]["decoder"]
    assert [p["id"] for p in every["highest"]] == [3, 5]
    assert [p["id"] for p in every["lowest"]] == [2, 1]


def test_encoder_and_decoder_are_separate_stacks():
    counts = RoutingCounts(
        ["encoder_0", "encoder_1", "decoder_1"], ["encoder", "encoder", "decoder"], vocab_size=6
    )
    assert counts.stacks == ["encoder", "decoder"]
    batch = {
        "encoder_inputs": np.array([[3, 4, 0]]),  # id 0 is encoder padding
        "inputs": np.array([[0, 3]]),  # the decoder's start token 0 is a real position
        "weights": np.array([[1.0, 1.0]]),
    }
    masks = {
        "encoder_0": np.array([[1, 0, 1]], bool),
        "encoder_1": np.array([[1, 1, 1]], bool),
        "decoder_1": np.array([[0, 1]], bool),
    }
    analysis_probe._count_batch(counts, batch, masks)
    summary = summarize(counts)
    assert [r["top2_rate"] for r in summary["layers"]] == pytest.approx([0.5, 1.0, 0.5])
    assert summary["stacks"]["encoder"]["tokens"] == 2
    assert summary["stacks"]["encoder"]["top2_rate"] == pytest.approx(0.75)
    assert summary["stacks"]["decoder"]["top2_rate"] == pytest.approx(0.5)


def test_counts_match_a_naive_token_loop():
    rng = np.random.default_rng(1)
    vocab, layers = 12, 3
    counts = RoutingCounts([f"layer_{i}" for i in range(layers)], ["decoder"] * layers, vocab)
    tokens_seen = defaultdict(int)
    top2_by_id = defaultdict(int)  # (layer, id) -> count
    top2_by_pos = defaultdict(int)  # (layer, position) -> count
    pos_seen = defaultdict(int)
    for length in (5, 9, 3):
        tokens = rng.integers(0, vocab, (4, length))
        valid = rng.random((4, length)) < 0.8
        top2 = rng.random((layers, 4, length)) < 0.3
        counts.add("decoder", tokens, valid, top2)
        for b in range(4):
            for p in range(length):
                if not valid[b, p]:
                    continue
                tokens_seen[tokens[b, p]] += 1
                pos_seen[p] += 1
                for m in range(layers):
                    top2_by_id[m, tokens[b, p]] += int(top2[m, b, p])
                    top2_by_pos[m, p] += int(top2[m, b, p])
    summary = summarize(counts, min_count=1, top_n=vocab)
    total = sum(tokens_seen.values())
    for m, row in enumerate(summary["layers"]):
        assert row["top2_rate"] == pytest.approx(
            sum(top2_by_id[m, v] for v in range(vocab)) / total
        )
    for entry in summary["stacks"]["decoder"]["highest"]:
        v, n = entry["id"], tokens_seen[entry["id"]]
        assert entry["count"] == n
        assert entry["top2_rate"] == pytest.approx(
            sum(top2_by_id[m, v] for m in range(layers)) / (n * layers)
        )
    for row in summary["stacks"]["decoder"]["by_position"]:
        lo, _, hi = row["bucket"].partition("-")
        span = range(int(lo), int(hi or lo) + 1)
        n = sum(pos_seen[p] for p in span)
        hits = sum(top2_by_pos[m, p] for m in range(layers) for p in span)
        assert row["tokens"] == n and row["top2_rate"] == pytest.approx(hits / (n * layers))


def test_bucket_edges():
    assert frequency_bucket_edges(70, 4) == [(1, 3), (4, 15), (16, 63), (64, 255)]
    assert frequency_bucket_edges(0, 4) == [(1, 3)]
    assert position_bucket_edges(10) == [(0, 0), (1, 1), (2, 3), (4, 7), (8, 9)]
    assert position_bucket_edges(1) == [(0, 0)]


def test_bad_input_is_one_clear_error():
    counts = RoutingCounts(["layer_0"], ["decoder"], vocab_size=4)
    with pytest.raises(ValueError, match=r"token id 9 outside the model's vocabulary \[0, 4\)"):
        counts.add("decoder", np.array([[9]]), np.array([[True]]), np.array([[[True]]]))
    with pytest.raises(ValueError, match="do not match 1 layers"):
        counts.add("decoder", np.array([[1, 2]]), np.ones((1, 2), bool), np.ones((2, 1, 2), bool))
    with pytest.raises(ValueError, match="not one of"):
        RoutingCounts(["x"], ["middle"], vocab_size=4)


def test_layer_names_follow_the_training_metrics():
    assert analysis_probe.layer_name(3) == ("layer_3", "decoder", 3)
    assert analysis_probe.layer_name("encoder_10") == ("encoder_10", "encoder", 10)
    config = tiny_config("model.arch=encoder_decoder", "model.moe.every=2", "model.num_layers=4")
    assert analysis_probe.moe_layers(config) == [
        ("encoder_1", "encoder"),
        ("encoder_3", "encoder"),
        ("decoder_1", "decoder"),
        ("decoder_3", "decoder"),
    ]


# ---- end to end: a tiny random model on an expert-parallel mesh of the 8 CPU devices ----

NUM_EXAMPLES, LENGTH = 16, 17  # two batches of 8 sequences with 16 routed tokens each


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    root = tmp_path_factory.mktemp("analysis")
    config = tiny_config(
        "mesh.expert=2", "model.moe.threshold=0.3", f"data.cache_dir={root / 'cache'}"
    )
    graphdef, params = model_params(build_model(config.model, rngs=nnx.Rngs(params=0)))
    params = jax.device_get(params)  # host arrays, as save_params expects
    save_params(str(root / "checkpoint"), params, config)
    ids = np.random.default_rng(0).integers(3, config.model.vocab_size, (NUM_EXAMPLES, LENGTH))
    data = root / "data.jsonl"
    data.write_text("\n".join(json.dumps({"targets": row.tolist()}) for row in ids))

    flags = ["--checkpoint", str(root / "checkpoint"), "--data", f"jsonl:{data}"]
    args = build_parser().parse_args(
        ["analyze-routing", *flags, "--out", str(root / "out"), "--min_count", "3"]
    )
    args.overrides = []
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert args.run(args) == 0
    line = json.loads(stdout.getvalue().strip().splitlines()[-1])
    report = json.loads((root / "out" / "routing.json").read_text())
    return graphdef, params, ids, line, report, root / "out"


def test_end_to_end_writes_every_file(analysed):
    *_, line, _, out = analysed
    names = {"routing.json", "summary.md", "top2_by_layer.png", "top2_by_frequency.png"}
    assert names | {"top2_by_position.png"} == {p.name for p in out.iterdir()}
    assert sorted(line["files"]) == sorted(str(p) for p in out.iterdir())
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (out / "summary.md").read_text()
    assert "| layer_1 | decoder | 256 |" in markdown


def test_end_to_end_counts_every_token_once(analysed):
    *_, report, _ = analysed
    decoder = report["stacks"]["decoder"]
    assert decoder["tokens"] == NUM_EXAMPLES * (LENGTH - 1)
    assert sum(r["tokens"] for r in decoder["by_frequency"]) == decoder["tokens"]
    assert [(r["bucket"], r["tokens"]) for r in decoder["by_position"]] == [
        ("0", 16),
        ("1", 16),
        ("2-3", 32),
        ("4-7", 64),
        ("8-15", 128),
    ]
    rates = [r["top2_rate"] for r in report["layers"]]
    rates += [p["top2_rate"] for p in decoder["highest"] + decoder["lowest"]]
    assert all(0.0 <= r <= 1.0 for r in rates)
    assert all(p["count"] >= 3 for p in decoder["highest"])


def test_end_to_end_matches_the_training_metric(analysed):
    """Per-layer rates equal the MoE layer's own `top2_fraction` (every position is valid)."""
    graphdef, params, ids, line, report, _ = analysed
    run = jax.jit(lambda p, b: forward(graphdef, p, b, train=True)[1])
    fractions = defaultdict(list)
    for rows in np.split(ids, 2):
        aux = run(params, {"inputs": rows[:, :-1]})
        for layer, values in aux.items():
            fractions[f"layer_{layer}"].append(float(values["top2_fraction"]))
    expected = {name: np.mean(values) for name, values in fractions.items()}
    assert line["top2_rate_per_layer"] == pytest.approx(expected, abs=1e-6)
    assert 0.0 < report["stacks"]["decoder"]["top2_rate"] < 1.0  # the test can tell 0/1 apart


def test_end_to_end_encoder_decoder_counts_both_stacks(tmp_path):
    config = tiny_config(
        "model.arch=encoder_decoder",
        "model.activation=gelu",
        "model.rope_theta=0.0",
        "model.moe.every=2",
        "mesh.expert=2",
    )
    _, params = model_params(build_model(config.model, rngs=nnx.Rngs(params=1)))
    save_params(str(tmp_path / "checkpoint"), jax.device_get(params), config)
    rng = np.random.default_rng(2)
    records = [
        {
            "inputs": rng.integers(3, 100, rng.integers(4, 20)).tolist(),
            "targets": rng.integers(3, 100, rng.integers(2, 9)).tolist(),
        }
        for _ in range(10)
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records))
    report = analysis.analyze_routing(
        str(tmp_path / "checkpoint"), f"jsonl:{data}", str(tmp_path / "out"), min_count=1
    )
    assert [r["layer"] for r in report["layers"]] == ["encoder_1", "decoder_1"]
    # No tokenizer: read_jsonl adds no EOS to id lists, so the counts are the list lengths.
    encoder, decoder = report["stacks"]["encoder"], report["stacks"]["decoder"]
    assert encoder["tokens"] == sum(len(r["inputs"]) for r in records)
    assert decoder["tokens"] == sum(len(r["targets"]) for r in records)
    assert all(0.0 <= r["top2_rate"] <= 1.0 for r in report["layers"])
    assert decoder["highest"][0]["piece"].startswith("<id ")
    assert "## By position (encoder)" in (tmp_path / "out" / "summary.md").read_text()
