"""What `jaxmoe train` says when it stops (training/run_report.py) and the loss-curve picture
it draws (training/curves.py), from hand-written metrics rows; the whole story on a real run
is tests/test_readme.py's."""

import json

from ml_collections import ConfigDict

from jaxmoe.training.curves import curve_panels, write_curves
from jaxmoe.training.run_report import report

ROWS = [
    {"step": 10, "split": "train", "loss": 6.0, "learning_rate": 1e-3, "top2_fraction": 0.2},
    {"step": 20, "split": "train", "loss": 5.0, "learning_rate": 2e-3, "top2_fraction": 0.3},
    {"step": 20, "split": "eval", "loss": 5.5, "perplexity": 244.7, "accuracy": 0.1},
    {"step": 30, "split": "train", "loss": 4.0, "learning_rate": 3e-3, "top2_fraction": 0.25},
    {"step": 30, "split": "eval", "loss": 4.5, "perplexity": 90.0, "accuracy": 0.2},
    {"step": 30, "split": "goodput", "goodput": {"step": 0.5}},
]


def config(source="embedded", arch="decoder", steps=30) -> ConfigDict:
    return ConfigDict(
        {"data": {"source": source}, "model": {"arch": arch}, "train": {"steps": steps}}
    )


def test_curves_plot_the_rows_they_are_given(tmp_path):
    loss, routing = curve_panels(ROWS)
    assert loss == {
        "train loss": ([10, 20, 30], [6.0, 5.0, 4.0]),
        "eval loss": ([20, 30], [5.5, 4.5]),
    }
    assert routing == {"tokens to two experts": ([10, 20, 30], [0.2, 0.3, 0.25])}
    dense = [{k: v for k, v in r.items() if k != "top2_fraction"} for r in ROWS]
    assert curve_panels(dense)[1] == {"learning rate": ([10, 20, 30], [1e-3, 2e-3, 3e-3])}
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in ROWS) + '{"step": 4\n'  # a torn last line
    )
    path = write_curves(tmp_path)
    assert path == str(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "curves.png.tmp").exists()


def test_no_picture_before_a_training_row(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    assert write_curves(tmp_path) is None and not (tmp_path / "curves.png").exists()


def test_a_run_that_trained_says_what_it_wrote_where_and_what_next(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "my run"
    summary = {
        "step": 30,
        "eval": {"loss": 4.5, "perplexity": 90.0, "accuracy": 0.2},
        "stopped": None,
        "tensorboard": str(run / "tensorboard"),
        "metrics": str(run / "metrics.jsonl"),
        "curves": str(run / "curves.png"),
    }
    chat = report(summary, str(run), config(f"jsonl:{tmp_path}/chat.jsonl"))
    assert chat[-3] == "  jaxmoe eval --checkpoint 'runs/my run' --data jsonl:chat.jsonl"
    assert report(summary, str(run), config()) == [
        "done: step 30, eval loss 4.5000 (perplexity 90.00, accuracy 0.200)",
        "runs/my run/ holds:",
        "  checkpoints/30/  the model, optimizer state, config and tokenizer",
        "  metrics.jsonl    a JSON row per logged step and evaluation",
        "  curves.png       the loss curves",
        "  tensorboard/     tensorboard --logdir runs/my run/tensorboard",
        "next:",
        "  jaxmoe eval --checkpoint 'runs/my run' --data embedded",
        "  jaxmoe decode --checkpoint 'runs/my run' --prompt \"The\" --max_new_tokens 32",
        "  jaxmoe export hf 'runs/my run' 'exported/my run'",
    ]


def test_a_finished_run_says_so_with_its_last_evaluation(tmp_path):
    run = tmp_path / "t5"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    summary = {
        "step": 30,
        "eval": None,
        "stopped": "finished",
        "tensorboard": str(run / "tensorboard"),
        "metrics": str(run / "metrics.jsonl"),
        "curves": None,
    }
    lines = report(summary, str(run), config("jsonl:/data/*.jsonl", "encoder_decoder"))
    assert lines[0] == (
        f"{run} is finished: step 30 of train.steps=30, nothing left to train "
        "(--config.train.steps=N with N > 30 trains on from it); its last eval loss 4.5000 "
        "(perplexity 90.00, accuracy 0.200), step 30"
    )
    assert "curves.png" not in "\n".join(lines)  # none was drawn
    assert lines[-3:] == [
        f"  jaxmoe eval --checkpoint {run} --data jsonl:FILE",
        f'  jaxmoe decode --checkpoint {run} --prompt "The" --max_new_tokens 32',
        f"  jaxmoe export t5x {run} t5x_out",
    ]
