"""`jaxmoe eval --task generate`: metrics against values worked out by hand, and beam search
on a tiny T5 checkpoint giving the same outputs on one device and on a mesh."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("rouge_score")
pytest.importorskip("sacrebleu")

from jaxmoe.checkpoints.manager import save_params
from jaxmoe.cli import main
from jaxmoe.data.sources import load_tokenizer
from jaxmoe.inference.generate_eval import text_metrics, token_f1
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params
from tests.fixtures_data import copy_data_cache
from tests.helpers import TINY_T5, tiny_config

REPO = Path(__file__).resolve().parent.parent


def test_rouge_and_bleu_equal_hand_counts():
    # 5 of 6 unigrams shared, 3 of 5 bigrams, longest common subsequence 5 of 6.
    got = text_metrics(["the cat sat on the mat"], ["the cat lay on the mat"])
    assert got["rouge1"] == pytest.approx(100 * 5 / 6)
    assert got["rouge2"] == pytest.approx(100 * 3 / 5)
    assert got["rougeL"] == pytest.approx(100 * 5 / 6)
    # n-gram precisions 5/6, 3/5, 2/4, 1/3, equal lengths (no brevity penalty).
    bleu = text_metrics(["a b c d e f"], ["a b c d x f"])["bleu"]
    assert bleu == pytest.approx(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25, abs=1e-3)


def test_exact_match_and_f1_follow_squad():
    got = text_metrics(["The Eiffel Tower!", "in Paris France"], ["eiffel tower", "Paris"])
    assert got["exact_match"] == pytest.approx(50.0)
    # 1 shared token: precision 1/3, recall 1 -> F1 1/2; the first pair scores 1.
    assert got["f1"] == pytest.approx(100 * (1 + 0.5) / 2)
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0


@pytest.fixture(scope="module")
def t5_checkpoint(tmp_path_factory, embedded_data_cache):
    root = tmp_path_factory.mktemp("t5")
    copy_data_cache(embedded_data_cache, root / "cache")  # its tokenizer, trained once
    tokenizer = load_tokenizer(tiny_config(f"data.cache_dir={root / 'cache'}").data).path
    config = tiny_config(
        *TINY_T5,
        "model.vocab_size=512",
        f"data.tokenizer={tokenizer}",
    )
    _, params = model_params(build_model(config.model, rngs=nnx.Rngs(4)))
    save_params(str(root / "ckpt"), jax.device_get(params), config)
    pairs = [
        ("translate: the house is small", "das Haus ist klein"),
        ("summarize: a long text about rivers and the sea", "rivers flow to the sea"),
        ("question: what is two plus two?", "four"),
        ("the cat", "sat on the mat"),
        ("question: capital of France?", "Paris"),
    ]
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps({"inputs": i, "targets": t}) + "\n" for i, t in pairs))
    return root


def run_eval(capsys, checkpoint, *flags):
    argv = ["eval", "--checkpoint", str(checkpoint / "ckpt"), "--task", "generate"]
    argv += ["--data", f"jsonl:{checkpoint / 'pairs.jsonl'}", *flags]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_beam_search_on_t5_same_on_one_device_and_a_mesh(t5_checkpoint, tmp_path, capsys):
    beam = ["--num_beams", "3", "--max_new_tokens", "6", "--batch_size", "8"]
    mesh = run_eval(
        capsys, t5_checkpoint, *beam, "--output", str(tmp_path / "mesh.jsonl"),
        "--config.mesh.data=4", "--config.mesh.tensor=2",
    )  # fmt: skip
    # One device: a fresh process that sees a single CPU device.
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    argv = ["eval", "--checkpoint", str(t5_checkpoint / "ckpt"), "--task", "generate"]
    argv += ["--data", f"jsonl:{t5_checkpoint / 'pairs.jsonl'}", *beam]
    argv += ["--output", str(tmp_path / "one.jsonl")]
    process = subprocess.run(
        [sys.executable, "-m", "jaxmoe.cli", *argv], env=env, capture_output=True, text=True
    )
    assert process.returncode == 0, process.stderr[-2000:]
    one = json.loads(process.stdout.strip().splitlines()[-1])
    assert mesh["mesh"]["tensor"] == 2 and one["mesh"]["data"] == 1 and one["mesh"]["tensor"] == 1
    outputs = [(tmp_path / name).read_text().splitlines() for name in ("mesh.jsonl", "one.jsonl")]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 5
    predictions = [json.loads(line)["prediction"] for line in outputs[0]]
    assert any(predictions)
    # The summary is the libraries' score of the predictions written per example.
    import sacrebleu
    from rouge_score import rouge_scorer

    targets = [json.loads(line)["targets"] for line in outputs[0]]
    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
    rouge1 = np.mean(
        [scorer.score(t, p)["rouge1"].fmeasure for p, t in zip(predictions, targets, strict=True)]
    )
    assert mesh["rouge1"] == pytest.approx(100 * rouge1)
    assert mesh["bleu"] == pytest.approx(sacrebleu.corpus_bleu(predictions, [targets]).score)
    assert mesh["decoding"] == "beam3 alpha=0.6" and mesh["new_tokens"] > 0
    assert mesh["tokens_per_s"] > 0
    greedy = run_eval(capsys, t5_checkpoint, "--max_new_tokens", "6")
    assert greedy["decoding"] == "greedy" and greedy["num_examples"] == 5


def test_bad_generate_flags(t5_checkpoint, capsys):
    argv = ["eval", "--checkpoint", str(t5_checkpoint / "ckpt"), "--task", "generate"]
    assert main([*argv, "--data", "embedded"]) == 2
    assert "reads --data jsonl:FILE" in capsys.readouterr().err
    data = ["--data", f"jsonl:{t5_checkpoint / 'pairs.jsonl'}"]
    assert main([*argv, *data, "--num_beams", "2", "--temperature", "0.5"]) == 2
    assert "does not sample" in capsys.readouterr().err
