"""`jaxmoe lm-eval` on 2 processes (launch/local.sh) equals the 1-process run.

Each process is one of lm-eval's data-parallel ranks: it scores every other document on its
own 4 devices and process 0 gathers the results. The reference is the same command on one
process; the tasks are lm-eval custom tasks written into tmp_path (loglikelihood,
loglikelihood_rolling and generate_until; nothing downloaded).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("lm_eval")

from jaxmoe.checkpoints.manager import save_params
from jaxmoe.conversions.hf.importer import abstract_params
from jaxmoe.data.sources import load_tokenizer
from tests.fixtures_data import copy_data_cache
from tests.helpers import tiny_config

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "tests" / "lm_eval_tasks"
NAMES = ["jaxmoe_tiny_mc", "jaxmoe_tiny_text", "jaxmoe_tiny_gen"]


def write_tasks(folder: Path) -> Path:
    """The repo's three tiny task files, their data read from absolute paths."""
    folder.mkdir()
    for name in ("tiny_mc", "tiny_text", "tiny_gen"):
        text = (TASKS / f"{name}.yaml").read_text()
        text = text.replace("tests/lm_eval_tasks/", f"{TASKS}/")
        if name == "tiny_gen":  # longer generations, stopped inside the loop at a string
            text = text.replace("max_gen_toks: 8", "max_gen_toks: 24")
            text = text.replace('until: ["\\n"]', 'until: ["\\n", ".", "may"]')
        (folder / f"{name}.yaml").write_text(text)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, embedded_data_cache):
    """A random dense decoder (peaked predictions) with jaxmoe's 512-piece tokenizer."""
    root = tmp_path_factory.mktemp("lm_eval_processes")
    cache = copy_data_cache(embedded_data_cache, root / "cache")
    tokenizer = load_tokenizer(tiny_config(f"data.cache_dir={cache}").data).path
    config = tiny_config(
        "model.moe.num_experts=0",
        "model.vocab_size=512",
        "train.seq_len=32",
        f"data.tokenizer={tokenizer}",
    )
    rng = np.random.default_rng(5)
    params = jax.tree.map(
        lambda a: (a.ndim == 1) + rng.standard_normal(a.shape, np.float32) / a.shape[0] ** 0.5,
        abstract_params(config.model),
    )
    save_params(str(root / "ckpt"), params, config)
    return root


def run_processes(n: int, root: Path, tasks: Path, out: Path) -> float:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    start = time.perf_counter()
    done = subprocess.run(
        ["bash", "launch/local.sh", str(n), "--devices_per_process", "4", "--", "lm-eval",
         "--model_args", f"checkpoint={root / 'ckpt'},mesh=data:4", "--tasks", ",".join(NAMES),
         "--include_path", str(tasks), "--batch_size", "4", "--output_path", str(out),
         "--log_samples"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return time.perf_counter() - start


def samples(out: Path, task: str) -> dict:
    (file,) = out.rglob(f"samples_{task}_*.jsonl")
    rows = [json.loads(line) for line in file.read_text().splitlines()]
    return {row["doc_id"]: row["filtered_resps"] for row in rows}


def same_scores(got, want) -> bool:
    """lm-eval's logged responses (nested lists of numbers and flags, as text) equal up to
    float32 rounding in the numbers."""
    if isinstance(want, list):
        return len(got) == len(want) and all(map(same_scores, got, want))
    if want in ("True", "False"):
        return got == want
    return abs(float(got) - float(want)) <= 1e-5 * abs(float(want)) + 1e-4


@pytest.mark.slow  # two lm-eval runs under launch/local.sh: ~2-4 min on the loaded host
def test_two_processes_equal_one(checkpoint, tmp_path):
    tasks = write_tasks(tmp_path / "tasks")
    run_processes(1, checkpoint, tasks, tmp_path / "one")
    run_processes(2, checkpoint, tasks, tmp_path / "two")
    for task in NAMES:
        one, two = samples(tmp_path / "one", task), samples(tmp_path / "two", task)
        assert sorted(one) == sorted(two) == list(range(len(one))), task
        for doc, want in one.items():
            got = two[doc]
            if task == "jaxmoe_tiny_gen":
                assert got == want, (doc, got, want)
            else:  # one compiled batch shape or another: float32 rounding at most
                assert same_scores(got, want), (task, doc, got, want)
    (one_file,) = (tmp_path / "one").rglob("results_*.json")
    (two_file,) = (tmp_path / "two").rglob("results_*.json")
    one = json.loads(one_file.read_text())["results"]
    two = json.loads(two_file.read_text())["results"]
    assert one["jaxmoe_tiny_gen"]["exact_match,none"] == two["jaxmoe_tiny_gen"]["exact_match,none"]
    assert one["jaxmoe_tiny_mc"]["acc,none"] == two["jaxmoe_tiny_mc"]["acc,none"]
    np.testing.assert_allclose(
        one["jaxmoe_tiny_text"]["bits_per_byte,none"],
        two["jaxmoe_tiny_text"]["bits_per_byte,none"],
        rtol=1e-6,
    )


def run_eval(n: int, root: Path, *flags) -> dict:
    """`jaxmoe eval` under launch/local.sh: process 0's printed result."""
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        ["bash", "launch/local.sh", str(n), "--devices_per_process", "4", "--", "eval",
         "--checkpoint", str(root / "ckpt"), "--config.mesh.data=4", *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line[4:] for line in done.stdout.splitlines() if line.startswith("[0] {")]
    return json.loads(lines[-1])


@pytest.mark.slow  # four `jaxmoe eval` runs under launch/local.sh: ~2-3 min on the loaded host
def test_eval_score_and_generate_on_two_processes_equal_one(checkpoint, tmp_path):
    texts = [f"the river number {i} runs {'far ' * (i % 5)}to the sea." for i in range(13)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"inputs": t[:12], "targets": t}) + "\n" for t in texts))
    score = ("--data", f"jsonl:{data}", "--per_example", "--config.train.batch_size=4")
    one, two = run_eval(1, checkpoint, *score), run_eval(2, checkpoint, *score)
    assert one["per_example"] == two["per_example"] and one["loss"] == two["loss"]
    generate = (
        "--task", "generate", "--data", f"jsonl:{data}", "--max_new_tokens", "12",
        "--batch_size", "4", "--stop", "a", "--output",
    )  # fmt: skip
    one = run_eval(1, checkpoint, *generate, str(tmp_path / "one.jsonl"))
    two = run_eval(2, checkpoint, *generate, str(tmp_path / "two.jsonl"))
    assert (tmp_path / "one.jsonl").read_text() == (tmp_path / "two.jsonl").read_text()
    assert one["new_tokens"] == two["new_tokens"] and one["rouge1"] == two["rouge1"]


def test_builtin_task_index_skipped_only_for_include_path_tasks():
    """lm-eval's built-in task index (every process's start-up) is skipped only when each
    --tasks name is a task of --include_path's own."""
    from lm_eval import tasks

    from jaxmoe.inference.lm_eval_backend import builtin_tasks_skipped, included_tasks_only

    ours = ["--include_path", str(TASKS), "--tasks"]
    assert included_tasks_only([*ours, "jaxmoe_tiny_mc,jaxmoe_tiny_gen"])
    assert included_tasks_only([*ours, "jaxmoe_tiny_mc", "jaxmoe_tiny_text"])
    assert not included_tasks_only([*ours, "jaxmoe_tiny_mc,hellaswag"])  # a built-in task
    assert not included_tasks_only(["--tasks", "jaxmoe_tiny_mc"])  # no --include_path
    full = tasks.TaskManager
    with builtin_tasks_skipped(True):
        assert tasks.TaskManager(include_path=str(TASKS)).all_tasks == sorted(NAMES)
    assert tasks.TaskManager is full
