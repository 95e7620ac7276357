"""The suite keeps its own times: with JAXMOE_TEST_TIMES set to a folder, a test run writes
FOLDER/YYYY-MM-DD-tests-LANE.json (LANE: JAXMOE_TEST_LANE, default "tests"): the run's wall
time, its test count and outcomes, the host it ran on, and its slowest tests (setup, call
and teardown together), the same shape of record as the benchmarks' dated results.
.ci/run sets both for each lane and prints where the files went; nothing commits them.

tests/conftest.py imports these hooks. Under pytest-xdist the controller writes the file:
the workers' reports reach it through pytest_runtest_logreport.
"""

import datetime
import json
import os
import time
from pathlib import Path

SLOWEST = 40  # tests listed, slowest first

_durations: dict[str, float] = {}
_outcomes: dict[str, str] = {}
_start = [0.0]


def pytest_sessionstart(session):
    _start[0] = time.perf_counter()


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    if report.when == "call" or report.outcome != "passed":
        _outcomes[report.nodeid] = report.outcome  # a failed setup counts, not its teardown


def lane_record(lane: str, seconds: float, durations: dict, outcomes: dict) -> dict:
    """The JSON record of one lane: wall time, counts, the slowest tests."""
    slowest = sorted(durations.items(), key=lambda item: -item[1])[:SLOWEST]
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return {
        "lane": lane,
        "date": datetime.date.today().isoformat(),
        "lane_seconds": round(seconds, 1),
        "tests": len(outcomes),
        "outcomes": counts,
        "test_seconds": round(sum(durations.values()), 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "slowest": [{"test": name, "seconds": round(s, 2)} for name, s in slowest],
    }


def pytest_sessionfinish(session, exitstatus):
    folder = os.environ.get("JAXMOE_TEST_TIMES")
    if not folder or hasattr(session.config, "workerinput"):  # an xdist worker: not its job
        return
    lane = os.environ.get("JAXMOE_TEST_LANE", "tests")
    from benchmarks.host_info import host_info  # stdlib only: CPU, cores, library versions

    record = lane_record(lane, time.perf_counter() - _start[0], _durations, _outcomes)
    record["host"] = host_info()
    path = Path(folder) / f"{record['date']}-tests-{lane}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"lane times: {path}")
