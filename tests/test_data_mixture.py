"""Mixtures of sources: parsing, realised proportions, per-source epochs, exact resume,
process sharding, and a training run with per-source eval losses.

References: counts by example-id range, sets of ids, hand-normalised weights.
"""

import json

import numpy as np
import pytest

from jaxmoe.data.mixture import Component, MixtureBatches, parse_mixture
from jaxmoe.storage.paths import absolute_mixture
from tests.fixtures_data import build_data
from tests.test_data_sources import CONFIG, build_bpe, documents, write_jsonl


class IdExamples:
    """Test double for a source: example i is one row holding i."""

    def __init__(self, n: int):
        self.n, self.num_tokens = n, 10 * n

    def __len__(self):
        return self.n

    def batch(self, ids_B):
        ids_B = np.asarray(ids_B)
        return {"inputs": ids_B[:, None].astype(np.int32), "example_ids": ids_B.astype(np.int32)}


def mixture(sizes, weights, batch_size=64, rows=None, seed=0):
    components = [Component(f"text:/s{k}", w, f"s{k}") for k, w in enumerate(weights)]
    parts = [IdExamples(n) for n in sizes]
    return MixtureBatches(components, parts, batch_size, seed, rows or slice(0, batch_size))


def test_parse_mixture():
    parts = parse_mixture(" jsonl:/a/wiki/*.jsonl=0.7, jsonl:/b/*.jsonl=0.1,tfds:c4/en:3.1.0=0.2")
    assert [p.source for p in parts] == [
        "jsonl:/a/wiki/*.jsonl",
        "jsonl:/b/*.jsonl",
        "tfds:c4/en:3.1.0",
    ]
    assert [p.weight for p in parts] == pytest.approx([0.7, 0.1, 0.2])
    assert [p.name for p in parts] == ["wiki", "b", "c4_en"]
    assert [p.weight for p in parse_mixture("embedded=3,text:/x/a.txt=1")] == [0.75, 0.25]
    assert [p.name for p in parse_mixture("embedded=1,embedded=1")] == ["embedded", "embedded_1"]
    assert parse_mixture("") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("jsonl:/a/*.jsonl", "is not SOURCE=WEIGHT"),
        ("jsonl:/a/*.jsonl=0", "positive weight"),
        ("jsonl:/a/*.jsonl=x", "positive weight"),
        ("csv:/a=1", "data.mixture: data.source='csv:/a'"),
    ],
)
def test_bad_mixture_is_one_line(text, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_mixture(text)
    assert "\n" not in str(error.value)


def test_absolute_mixture(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert (
        absolute_mixture("jsonl:a/*.jsonl=0.7,tfds:c4=0.3")
        == f"jsonl:{tmp_path}/a/*.jsonl=0.7,tfds:c4=0.3"
    )


def test_realised_proportions_match_weights():
    mix = mixture([500, 70, 3000], [0.7, 0.1, 0.2])
    ids = np.concatenate([next(mix)["example_ids"] for _ in range(2000)])  # 128,000 rows
    source = np.searchsorted(np.array([500, 570]), ids, side="right")  # by id range
    realised = np.bincount(source, minlength=3) / ids.size
    np.testing.assert_allclose(realised, [0.7, 0.1, 0.2], atol=0.01)


def test_each_source_visits_all_its_examples_once_per_epoch():
    mix = mixture([50, 20], [0.5, 0.5], batch_size=8)
    ids = np.concatenate([next(mix)["example_ids"] for _ in range(100)])
    for offset, n in ((0, 50), (50, 20)):
        mine = ids[(ids >= offset) & (ids < offset + n)] - offset
        for epoch in range(len(mine) // n):
            assert sorted(mine[epoch * n : (epoch + 1) * n]) == list(range(n))
    assert mix.get_state()["consumed"] == [int((ids < 50).sum()), int((ids >= 50).sum())]


def test_resume_and_processes_reproduce_the_uninterrupted_batches():
    full = mixture([50, 20], [0.6, 0.4], batch_size=8, seed=3)
    expected = [next(full)["inputs"] for _ in range(30)]
    first = mixture([50, 20], [0.6, 0.4], batch_size=8, seed=3)
    for _ in range(11):
        next(first)
    state = json.loads(json.dumps(first.get_state()))
    halves = [mixture([50, 20], [0.6, 0.4], 8, slice(p * 4, p * 4 + 4), seed=3) for p in (0, 1)]
    for half in halves:
        half.set_state(state)
    for step in range(11, 30):
        together = np.concatenate([next(h)["inputs"] for h in halves])
        np.testing.assert_array_equal(together, expected[step])
    other = mixture([50, 21], [0.6, 0.4], batch_size=8)
    with pytest.raises(ValueError, match="num_examples"):
        other.set_state(state)


def test_mixture_trains_and_reports_per_source_eval_losses(tmp_path):
    from jaxmoe.training.loop import train
    from tests.helpers import tiny_config

    write_jsonl(tmp_path / "wiki" / "a.jsonl", documents(300, "wiki"))
    write_jsonl(tmp_path / "code" / "b.jsonl", [f"def f{i}(x): return x + {i}" for i in range(600)])
    build_bpe(tmp_path / "tok", CONFIG)
    mix = f"jsonl:{tmp_path}/wiki/*.jsonl=0.7,jsonl:{tmp_path}/code/*.jsonl=0.3"
    config = tiny_config(
        "model.moe.num_experts=0",
        "train.steps=3",
        "train.eval_every=0",
        "train.eval_batches=1",
        "model.vocab_size=0",
        f"data.tokenizer={tmp_path}/tok",
        f"data.mixture={mix}",
        f"data.cache_dir={tmp_path}/cache",
    )
    bundle = build_data(config)
    assert list(bundle.eval_sets) == ["wiki", "code"]
    # Realised shares over 4,000 batches of 8 rows of the real sources (ids by source range).
    wiki_examples = bundle.train.sizes[0]
    ids = np.concatenate([next(bundle.train)["example_ids"] for _ in range(4000)])
    assert abs(np.mean(ids < wiki_examples) - 0.7) < 0.01
    summary = train(config, str(tmp_path / "run"), progress=False)
    result = summary["eval"]
    low, high = sorted([result["loss/wiki"], result["loss/code"]])
    assert np.isfinite(low) and low <= result["loss"] <= high
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("loss/code" in line for line in lines if line["split"] == "eval")
