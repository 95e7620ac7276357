"""The lm-evaluation-harness backend against lm-eval's own Hugging Face backend.

A dense jaxmoe checkpoint is exported with `jaxmoe export hf` (weights and tokenizer) and
the same local tasks (tests/lm_eval_tasks: YAML + jsonl, nothing downloaded) are run by
`--model hf` on transformers' Llama and by `--model jaxmoe` on the checkpoint, sharded on
a data x tensor mesh: every document's log-likelihoods, the generations and the metrics
must agree. Adaptive MoE, which Hugging Face cannot express, runs through the command line.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("lm_eval")

import lm_eval
from lm_eval.tasks import TaskManager

from jaxmoe.checkpoints.manager import save_params
from jaxmoe.conversions.hf.exporter import export_hf
from jaxmoe.conversions.hf.importer import abstract_params
from jaxmoe.data.sources import load_tokenizer
from jaxmoe.inference.lm_eval_backend import JaxmoeLM, mesh_overrides
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params
from tests.fixtures_data import copy_data_cache
from tests.helpers import TINY_T5, tiny_config

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "tests" / "lm_eval_tasks"
ALL_TASKS = ["jaxmoe_tiny_mc", "jaxmoe_tiny_text", "jaxmoe_tiny_gen"]
MAX_LENGTH = 32  # short, so contexts are truncated and long texts take several windows


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """Local task data only, read relative to the repo root as the task YAML says."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory, embedded_data_cache):
    """jaxmoe's 512-piece SentencePiece tokenizer, trained on the embedded corpus."""
    cache = copy_data_cache(embedded_data_cache, tmp_path_factory.mktemp("data") / "cache")
    return load_tokenizer(tiny_config(f"data.cache_dir={cache}").data).path


@pytest.fixture(scope="module", params=["decoder", "encoder_decoder"])
def dense(request, tmp_path_factory, tokenizer_path):
    """A dense decoder (Llama) or T5 with unit-scale random weights (peaked predictions, so
    choices differ clearly) saved as a jaxmoe checkpoint and exported for Hugging Face."""
    root = tmp_path_factory.mktemp(request.param)
    arch = (*TINY_T5, "model.num_kv_heads=4") if request.param == "encoder_decoder" else ()
    config = tiny_config(
        "model.moe.num_experts=0",
        "model.vocab_size=512",
        "model.norm_eps=1e-5",
        f"train.seq_len={MAX_LENGTH}",
        f"data.tokenizer={tokenizer_path}",
        *arch,
    )
    rng = np.random.default_rng(5)
    params = jax.tree.map(
        lambda a: (a.ndim == 1) + rng.standard_normal(a.shape, np.float32) / a.shape[0] ** 0.5,
        abstract_params(config.model),
    )
    save_params(str(root / "ckpt"), params, config)
    export_hf(str(root / "ckpt"), str(root / "hf"))
    return root, "seq2seq" if request.param == "encoder_decoder" else "causal"


def run_tasks(model, tasks=ALL_TASKS):
    return lm_eval.simple_evaluate(
        model=model,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def per_document(results, task):
    """doc_id -> the model's filtered responses (log-likelihoods or generated text)."""
    return {s["doc_id"]: s["filtered_resps"] for s in results["samples"][task]}


def same_text_up_to_bad_bytes(ours: str, hf: str) -> bool:
    """Equal, except where byte pieces that are not valid UTF-8 were decoded: tokenizers
    writes U+FFFD for every byte of such a run, SentencePiece only for the invalid ones."""
    return len(ours) == len(hf) and all(
        a == b or b == "\ufffd" for a, b in zip(ours, hf, strict=True)
    )


@pytest.mark.slow  # 110-200 s wall on the loaded shared host: three tasks, both backends
def test_same_loglikelihoods_generations_and_metrics_as_hf_backend(dense):
    from lm_eval.models.huggingface import HFLM

    dense, backend = dense
    hf = HFLM(
        pretrained=str(dense / "hf"),
        backend=backend,
        dtype="float32",
        device="cpu",
        batch_size=4,
        max_length=MAX_LENGTH,
    )
    if backend == "seq2seq":
        # lm-eval calls tie_weights() on every model, and transformers 5 declares every T5
        # tied, so a T5 v1.1 (separate output layer) would score with its input embedding.
        # Put the checkpoint's own output layer back.
        import torch
        from safetensors.torch import load_file

        weights = load_file(dense / "hf" / "model.safetensors")
        hf.model.lm_head.weight = torch.nn.Parameter(weights["lm_head.weight"])
    want = run_tasks(hf)
    ours = JaxmoeLM(checkpoint=str(dense / "ckpt"), mesh="data:4/tensor:2", batch_size=6)
    got = run_tasks(ours)
    # lm-eval's hf backend lets an encoder-decoder generate context length + max_gen_toks
    # tokens (it passes HF's max_length), jaxmoe max_gen_toks: only decoders compare texts.
    tasks = ALL_TASKS if backend == "causal" else ["jaxmoe_tiny_mc", "jaxmoe_tiny_text"]
    for task in tasks:
        g, w = per_document(got, task), per_document(want, task)
        assert sorted(g) == sorted(w) and len(g) >= 5
        for doc in w:
            if task == "jaxmoe_tiny_gen":
                assert same_text_up_to_bad_bytes(g[doc][0], w[doc][0])
            else:  # [(log-likelihood, greedy)] per choice, or [log-likelihood]
                lls = lambda resps: np.array([r[0] if isinstance(r, tuple) else r for r in resps])
                np.testing.assert_allclose(lls(g[doc]), lls(w[doc]), atol=1e-3, rtol=0)
        for metric, value in want["results"][task].items():
            if metric.endswith(",none") and "stderr" not in metric:
                assert got["results"][task][metric] == pytest.approx(value, rel=1e-5), metric
    # The task set exercises what it should: distinct choices, truncation, several windows.
    mc = per_document(want, "jaxmoe_tiny_mc")
    assert min(np.ptp([r[0] for r in resps]) for resps in mc.values()) > 0.1
    assert 0 < want["results"]["jaxmoe_tiny_mc"]["acc,none"] < 1
    generations = per_document(want, "jaxmoe_tiny_gen")
    assert all(texts[0] for texts in generations.values())
    ours_gen = per_document(got, "jaxmoe_tiny_gen")
    exact = [ours_gen[doc] == texts for doc, texts in generations.items()]
    assert sum(exact) >= len(exact) // 2 or backend == "seq2seq"
    # One compiled scoring shape per length bucket, rows fixed by the batch size.
    assert {shape[0] for shapes in ours.compiled_shapes for shape in shapes} == {8}
    assert len(ours.compiled_shapes) <= 3


def test_model_args_errors(dense):
    dense, _ = dense
    assert mesh_overrides("data:4/tensor:2") == ["mesh.data=4", "mesh.tensor=2"]
    with pytest.raises(ValueError, match="mesh='data=4'"):
        mesh_overrides("data=4")
    with pytest.raises(ValueError, match="checkpoint=PATH is required"):
        JaxmoeLM()
    with pytest.raises(ValueError, match="--model_args dtype: unknown"):
        JaxmoeLM(checkpoint=str(dense / "ckpt"), dtype="float32")
    lm = JaxmoeLM(checkpoint=str(dense / "ckpt"), max_length=8)
    with pytest.raises(ValueError, match="9 tokens does not fit in max_length=8"):
        lm._loglikelihood_tokens([(None, [1], list(range(3, 12)))])


def jaxmoe_cli(*args, cwd=REPO):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "jaxmoe.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow  # 120-150 s wall on the loaded shared host: lm-eval in a subprocess
def test_cli_runs_adaptive_moe_on_choice_and_generation_tasks(tmp_path, tokenizer_path):
    """`jaxmoe lm-eval` with lm-eval's own flags on an adaptive-gating MoE checkpoint."""
    config = tiny_config(
        "model.moe.gating=adaptive",
        "model.vocab_size=512",
        f"train.seq_len={MAX_LENGTH}",
        f"data.tokenizer={tokenizer_path}",
    )
    from flax import nnx

    _, params = model_params(build_model(config.model, rngs=nnx.Rngs(1)))
    save_params(str(tmp_path / "ckpt"), jax.device_get(params), config)
    result = jaxmoe_cli(
        "lm-eval",
        "--model_args",
        f"checkpoint={tmp_path / 'ckpt'},mesh=data:2/expert:4,max_gen_toks=8",
        "--tasks",
        "jaxmoe_tiny_mc,jaxmoe_tiny_gen",
        "--include_path",
        str(TASKS),
        "--batch_size",
        "8",
        "--output_path",
        str(tmp_path / "out"),
        "--log_samples",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "jaxmoe_tiny_mc" in result.stdout and "exact_match" in result.stdout
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    assert 0 <= results["jaxmoe_tiny_mc"]["acc,none"] <= 1
    assert results["jaxmoe_tiny_gen"]["exact_match,none"] == 0.0  # an untrained model
    bad = jaxmoe_cli("lm-eval", "--model", "hf", "--tasks", "x")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("jaxmoe lm-eval: error: --model is")
