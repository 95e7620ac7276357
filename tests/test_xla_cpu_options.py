"""benchmarks/xla_cpu_options.py: each option set's flags are added to the user's own
XLA_FLAGS, and a set whose worker dies is reported with the reason while the rest run
(slow: starts real workers on the tiny Mixtral)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import xla_cpu_options

ROOT = Path(__file__).resolve().parents[1]


def test_option_flags_are_added_to_the_users_own(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env = xla_cpu_options.option_env(xla_cpu_options.OPTIONS["eigen_dots"])
    assert env["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=8",
        "--xla_cpu_experimental_ynn_fusion_type=",
    ]
    monkeypatch.delenv("XLA_FLAGS")
    assert xla_cpu_options.option_env("")["XLA_FLAGS"] == ""


def test_default_is_always_measured():
    args = xla_cpu_options.parse_args(["--options", "eigen_dots"])
    assert args.options == ["default", "eigen_dots"]


@pytest.mark.slow
def test_a_flag_set_that_kills_its_worker_is_reported_and_the_rest_run(tmp_path, monkeypatch):
    out = tmp_path / "options.json"
    script = (
        "import sys\n"
        "from benchmarks import xla_cpu_options as o\n"
        "o.OPTIONS['unknown'] = '--xla_cpu_no_such_flag=true'\n"
        "sys.exit(o.main(sys.argv[1:]))\n"
    )
    command = [sys.executable, "-c", script, "--options", "unknown", "--steps", "2",
               "--warmup", "1", "--blocks", "1", "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {row["option"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["default"]["speed_vs_default"] == 1.0
    assert rows["default"]["final_loss"] > 0
    assert "exited" in rows["unknown"]["failed"]
