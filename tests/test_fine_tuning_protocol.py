"""experiments/fine_tuning_protocol.py: its tasks' data and its Table 3.

The sentiment labels are checked against a reading of each review written here (count the
negations of the deciding clause); the translation against the dictionary word by word;
the table against a hand-made report."""

import json
import re

import numpy as np
import pytest

from experiments import fine_tuning_protocol as ftp


def read_label(review: str) -> str:
    """The label a reader gives: the last clause decides; each negation flips it."""
    clause = review.split(", but ")[-1]
    positive = any(re.search(rf"\b{a}\b", clause) for a in ftp.POSITIVE)
    flips = clause.count("not ")
    return "positive" if positive != (flips % 2 == 1) else "negative"


def test_sentiment_labels_follow_the_last_clause_and_its_negations(tmp_path):
    ftp.write_task(tmp_path, "sentiment", 500, 50)
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    for row in rows:
        review = row["prompt"].removeprefix("review: ").removesuffix("\nsentiment:")
        assert row["completion"] == " " + read_label(review), row
    labels = [r["completion"] for r in rows]
    assert 0.4 < labels.count(" positive") / len(labels) < 0.6  # balanced
    assert sum("not true" in r["prompt"] for r in rows) > 50  # double negations occur
    test = (tmp_path / "test.jsonl").read_text().splitlines()
    assert len(test) == 50 and not set(test) >= set((tmp_path / "train.jsonl").read_text())


def test_translation_is_word_for_word_and_the_dictionary_one_to_one(tmp_path):
    words = ftp.dictionary()
    assert len(set(words.values())) == len(words) == len(ftp.WORDS)
    assert ftp.dictionary() == words  # fixed
    ftp.write_task(tmp_path, "translate", 100, 10)
    for line in (tmp_path / "train.jsonl").read_text().splitlines():
        row = json.loads(line)
        source = row["prompt"].removeprefix("translate: ").removesuffix("\nfrench:").split()
        assert row["completion"].split() == [words[w] for w in source]
        assert 2 <= len(source) <= 5


def stat(mean, std=None, reached=3, seeds=3):
    return {"mean": mean, "std": std, "values": [], "reached": reached, "seeds": seeds}


def test_table3_has_the_papers_layout():
    summary = {
        n: {"seconds_vs_top2_own": stat(ratio, 0.01), "quality_own": stat(quality)}
        for n, ratio, quality in (("dense", 0.5, 0.9), ("top2", 1.0, 0.95),
                                  ("top1", None, 0.8), ("adaptive_T0.1", 0.8, 0.96))
    }  # fmt: skip
    summary["top1"]["seconds_vs_top2_own"] = stat(None, reached=0)
    report = {
        "settings": {"variants": list(ftp.VARIANTS)},
        "tasks": {"sentiment": {"metric": "accuracy", "summary": summary}},
    }
    table = ftp.table3(report).splitlines()
    assert table[0].startswith("| task (metric) | dense | top2 | top1 | adaptive_T0.1 |")
    cells = [c.strip() for c in table[2].split("|")[1:-1]]
    assert cells[:5] == ["sentiment (accuracy)", "0.50x ± 0.01 / 0.900", "1.00x ± 0.01 / 0.950",
                         "not reached / 0.800", "0.80x ± 0.01 / 0.960"]  # fmt: skip
    assert "0.77x / 0.919" in cells[5]  # the paper's adaptive SST-2 cell beside it


def test_arguments_need_top2_and_known_names():
    with pytest.raises(SystemExit):
        ftp.parse_args(["--out", "x", "--variants", "dense,top1"])
    with pytest.raises(SystemExit):
        ftp.parse_args(["--out", "x", "--tasks", "squad"])
    args = ftp.parse_args(["--out", "x", "--quick"])
    assert (args.steps, args.seeds, args.tasks) == (8, [0, 1, 2], list(ftp.TASKS))
    assert np.isclose(args.learning_rate, 3e-3)
