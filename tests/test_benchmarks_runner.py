"""`python -m benchmarks`: every module of the package listed with its description, an
unknown name answered in one line, no module patching sys.path, and the dated results path."""

import ast
import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import results

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "benchmarks"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_"))


def runner(*argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "benchmarks", *argv]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_list_names_every_module_with_its_description():
    listed = runner("--list")
    assert listed.returncode == 0, listed.stderr
    assert runner().stdout == listed.stdout  # no argument: the same list
    lines = {line.split()[0]: line for line in listed.stdout.splitlines() if line[:2] == "  "}
    assert sorted(lines) == MODULES
    for name in MODULES:
        first_line = ast.get_docstring(ast.parse((PACKAGE / f"{name}.py").read_text()))
        assert first_line, f"benchmarks/{name}.py has no docstring"
        description = first_line.split("\n")[0].strip()
        assert lines[name].split(None, 1)[1] == description, name
    assert "train_throughput" in listed.stdout and "decode_peer" in listed.stdout


def test_no_benchmark_module_touches_sys_path():
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path":
                assert not (isinstance(node.value, ast.Name) and node.value.id == "sys"), (
                    f"{path.name}:{node.lineno} touches sys.path"
                )


def test_unknown_name_is_one_line_with_a_suggestion():
    done = runner("trian_throughput", "--steps", "1")
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert "unknown benchmark 'trian_throughput'" in line
    assert "did you mean train_throughput?" in line
    # A shared piece is not a benchmark either.
    assert "unknown benchmark 'results'" in runner("results").stderr


def test_a_benchmark_runs_through_the_runner_and_as_its_own_module():
    for command in (["benchmarks", "host_malloc"], ["benchmarks.host_malloc"]):
        done = subprocess.run(
            [sys.executable, "-m", *command, "--help"], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert "--json [PATH]" in done.stdout


def test_results_go_to_a_dated_file_and_the_table_is_markdown(tmp_path, capsys, monkeypatch):
    assert results.dated_path("decode_peer", datetime.date(2026, 12, 2)) == (
        ROOT / "docs" / "results" / "2026-12-02-decode_peer.json"
    )
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    table = results.markdown_table(["case", "ms"], [["MQA", 1.23456], ["MHA", None]])
    assert table == "| case | ms |\n|---|---|\n| MQA | 1.235 |\n| MHA | - |"
    path = results.publish("demo", {"x": 1}, table, results.DATED)
    assert path == tmp_path / f"{datetime.date.today():%Y-%m-%d}-demo.json"
    assert json.loads(path.read_text())["x"] == 1  # and "host" (test_benchmark_host)
    assert capsys.readouterr().out == table + "\n"
    results.publish("demo", {"x": 2}, table, "-")  # the JSON as stdout's last line
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["x"] == 2
    assert results.publish("demo", {"x": 3}, table, None) is None  # without --json: no file


@pytest.mark.parametrize("module", ["throughput_maxtext", "throughput_hf"])
def test_workers_for_other_interpreters_import_no_framework_through_the_package(module):
    """MaxText's worker runs under its venv's interpreter with only `-m` to find the package:
    importing it (and the package) must not need JAX, torch or jaxmoe."""
    probe = (
        f"import benchmarks.{module}, sys; "
        "print(sorted(m for m in ('jax', 'jaxmoe', 'torch') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"
