"""Importing jaxmoe costs only what the command needs (issue 29, item 2).

Each test runs a subprocess with tests/import_blocker on PYTHONPATH, so the blocked packages
import as if not installed: the training-step benchmark runs without the data and peer
packages, every `--help` answers with JAX itself blocked, and `jaxmoe train` on a data
source names the missing package and its extra in one line.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = ROOT / "tests" / "import_blocker"
OPTIONAL = ("tensorflow_datasets", "grain", "array_record", "tensorboardX", "torch")
JAX_STACK = ("jax", "jaxlib", "flax", "optax", "orbax", "ml_collections", "tensorstore")


def blocked_env(blocked, report_dir=None) -> dict:
    env = dict(os.environ, JAXMOE_BLOCK=",".join(blocked))
    env["PYTHONPATH"] = os.pathsep.join([str(BLOCKER), str(ROOT)])
    if report_dir is not None:
        env["JAXMOE_IMPORTS_REPORT"] = str(report_dir)
    return env


def imported_modules(report_dir: Path) -> dict[str, set[str]]:
    """Top-level modules each reported process had imported at exit, by report file."""
    return {p.name: set(p.read_text().split()) for p in report_dir.glob("modules-*.txt")}


@pytest.mark.slow
def test_training_step_benchmark_runs_without_optional_packages(tmp_path):
    command = [sys.executable, "-m", "benchmarks", "train_throughput", "--variants", "top2"]
    command += ["--steps", "2", "--warmup", "1", "--blocks", "1"]
    run = subprocess.run(
        command,
        cwd=ROOT,
        env=blocked_env(OPTIONAL, tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| top2 | jaxmoe |" in run.stdout
    reports = imported_modules(tmp_path)
    workers = {name: mods for name, mods in reports.items() if "jaxmoe" in mods}
    assert workers, f"no jaxmoe worker reported its imports: {sorted(reports)}"
    for name, modules in reports.items():
        assert not modules & set(OPTIONAL), (name, sorted(modules & set(OPTIONAL)))
    assert all("jax" in mods for mods in workers.values())  # the step really ran in JAX


HELP_COMMANDS = [
    [],
    ["train"],
    ["prepare"],
    ["eval"],
    ["decode"],
    ["compile"],
    ["analyze-routing"],
    ["convert"],
    ["convert", "t5x"],
    ["convert", "hf"],
    ["convert", "gqa"],
    ["convert", "upcycle"],
    ["export"],
    ["export", "hf"],
    ["export", "t5x"],
]

HELP_SCRIPT = """
import contextlib, io, json, sys
from jaxmoe.cli import main
out = {}
for words in json.loads(sys.argv[1]):
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            code = main([*words, "--help"])
        except SystemExit as done:
            code = done.code
    out[" ".join(words)] = [code, text.getvalue()]
heavy = sorted(m for m in sys.modules if m.partition(".")[0] in json.loads(sys.argv[2]))
print(json.dumps({"help": out, "heavy": heavy}))
"""


def test_every_help_answers_without_jax(tmp_path):
    import json

    run = subprocess.run(
        [sys.executable, "-c", HELP_SCRIPT, json.dumps(HELP_COMMANDS), json.dumps(JAX_STACK)],
        cwd=tmp_path,
        env=blocked_env((*JAX_STACK, *OPTIONAL)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["heavy"] == []
    for words, (code, text) in result["help"].items():
        assert code == 0, (words, text)
        assert text.startswith("usage: jaxmoe"), (words, text[:200])
    assert "{mean,first,random}" in result["help"]["convert gqa"][1]
    assert "{train,eval}" in result["help"]["analyze-routing"][1]
    compile_help = " ".join(result["help"]["compile"][1].split())
    assert "compile-only devices" in compile_help  # compile_check's docstring, read unimported


def test_console_script_help_without_jax(tmp_path):
    script = Path(sys.executable).with_name("jaxmoe")
    if not script.exists():
        pytest.skip(f"no jaxmoe console script next to {sys.executable}")
    run = subprocess.run(
        [str(script), "--help"],
        cwd=tmp_path,
        env=blocked_env((*JAX_STACK, *OPTIONAL), tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "train" in run.stdout and "convert" in run.stdout
    (modules,) = imported_modules(tmp_path).values()
    assert not modules & set(JAX_STACK)


def test_train_names_the_missing_data_package(tmp_path):
    command = [sys.executable, "-m", "jaxmoe", "train", "--config", "configs/tiny_mixtral.py"]
    command += ["--workdir", str(tmp_path / "run"), "--config.train.steps=1", "--no_progress"]
    run = subprocess.run(
        command,
        cwd=ROOT,
        env=blocked_env(OPTIONAL),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "tensorflow-datasets" in lines[0] and "pip install 'jaxmoe[data]'" in lines[0]
