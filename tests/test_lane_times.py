"""The suite's own time records (tests/lane_times.py), written by a real pytest run."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.lane_times import lane_record

ROOT = Path(__file__).resolve().parents[1]


def test_lane_record_counts_and_orders_by_hand():
    durations = {"a": 0.5, "b": 2.0, "c": 1.0}
    outcomes = {"a": "passed", "b": "failed", "c": "passed"}
    record = lane_record("fast", 10.0, durations, outcomes)
    assert record["lane"] == "fast" and record["lane_seconds"] == 10.0
    assert record["tests"] == 3 and record["outcomes"] == {"passed": 2, "failed": 1}
    assert record["test_seconds"] == 3.5
    assert [row["test"] for row in record["slowest"]] == ["b", "c", "a"]


def test_a_pytest_run_writes_its_lane_file(tmp_path):
    tests = tmp_path / "probe"
    tests.mkdir()
    (tests / "conftest.py").write_text(
        "from tests.lane_times import (pytest_runtest_logreport, pytest_sessionfinish,\n"
        "    pytest_sessionstart)  # noqa: F401\n"
    )
    (tests / "test_probe.py").write_text(
        "import time\n\ndef test_sleeps():\n    time.sleep(0.2)\n\ndef test_fails():\n"
        "    assert False\n"
    )
    env = dict(os.environ, JAXMOE_TEST_TIMES=str(tmp_path / "times"), JAXMOE_TEST_LANE="probe")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr  # one test fails on purpose
    (path,) = (tmp_path / "times").glob("*-tests-probe.json")
    record = json.loads(path.read_text())
    assert record["outcomes"] == {"passed": 1, "failed": 1}
    assert record["slowest"][0]["test"].endswith("test_probe.py::test_sleeps")
    assert record["slowest"][0]["seconds"] >= 0.2
    assert record["host"]["cpu_count"] >= 1
