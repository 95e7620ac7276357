"""metrics.jsonl on resume: rows after the restored step are dropped, earlier ones kept."""

import json

from jaxmoe.training.metrics import MetricsWriter


def test_resume_drops_rows_after_the_restored_step(tmp_path):
    rows = [
        {"step": 1, "split": "train", "loss": 3.0},
        {"step": 2, "split": "train", "loss": 2.5},
        {"step": 2, "split": "eval", "loss": 2.75},
        {"step": 3, "split": "train", "loss": 2.0},  # trained again after the restore of 2
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "spl'  # a torn line
    (tmp_path / "metrics.jsonl").write_text(text)

    writer = MetricsWriter(str(tmp_path), total_steps=4, start_step=2, progress=False)
    writer.write(3, "train", {"loss": 1.5})
    writer.close()

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "split": "train", "loss": 3.0},
        {"step": 2, "split": "train", "loss": 2.5},
        {"step": 2, "split": "eval", "loss": 2.75},
        {"step": 3, "split": "train", "loss": 1.5},
    ]


def test_fresh_run_starts_an_empty_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 7, "split": "train", "loss": 1.0}\n')
    writer = MetricsWriter(str(tmp_path), total_steps=2, start_step=0, progress=False)
    writer.write(1, "train", {"loss": 2.0})
    writer.close()
    assert (tmp_path / "metrics.jsonl").read_text() == (
        '{"step": 1, "split": "train", "loss": 2.0}\n'
    )
