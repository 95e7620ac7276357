"""`python -m benchmarks` and `python -m experiments` (one runner): every module of each
package listed with its description, an unknown name answered in one line, no module patching
sys.path, and the dated results path."""

import ast
import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import results

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("benchmarks", "experiments")


def module_names(package: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / package).glob("*.py") if not p.stem.startswith("_"))


def runner(*argv: str, package: str = "benchmarks") -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", package, *argv]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "package, expected",
    [
        ("benchmarks", ["train_throughput", "decode_peer"]),
        ("experiments", ["time_to_target", "gqa_ablation"]),
    ],
)
def test_list_names_every_module_with_its_description(package, expected):
    listed = runner("--list", package=package)
    assert listed.returncode == 0, listed.stderr
    assert runner(package=package).stdout == listed.stdout  # no argument: the same list
    lines = {line.split()[0]: line for line in listed.stdout.splitlines() if line[:2] == "  "}
    assert sorted(lines) == module_names(package)
    for name in module_names(package):
        source = (ROOT / package / f"{name}.py").read_text()
        first_line = ast.get_docstring(ast.parse(source))
        assert first_line, f"{package}/{name}.py has no docstring"
        description = first_line.split("\n")[0].strip()
        assert lines[name].split(None, 1)[1] == description, name
    assert all(name in listed.stdout for name in expected)


def test_benchmarks_and_experiments_do_not_share_a_name():
    assert not set(module_names("benchmarks")) & set(module_names("experiments"))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_touches_sys_path(package):
    for path in sorted((ROOT / package).glob("*.py")):
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
    # An experiment is not a benchmark: each runner runs its own package's modules.
    assert "unknown benchmark 'time_to_target'" in runner("time_to_target").stderr
    done = runner("gqa_ablaton", package="experiments")
    assert done.returncode == 2
    assert "unknown experiment 'gqa_ablaton': did you mean gqa_ablation?" in done.stderr
    assert "`python -m experiments --list`" in done.stderr


@pytest.mark.parametrize(
    "package, name", [("benchmarks", "decode_peer"), ("experiments", "stragglers")]
)
def test_a_module_runs_through_the_runner_and_as_its_own_module(package, name):
    for command in ([package, name], [f"{package}.{name}"]):
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
