"""Data across processes through the real CLI: 2 processes x 4 devices prepare the cache
once (process 0; process 1 waits at a barrier) and read disjoint rows whose union is the
global batch of a 1-process run (rows traced by JAXMOE_DATA_TRACE)."""

import json
import os
import subprocess
import sys

import pytest

from jaxmoe.data import multihost
from tests.fixtures_data import build_data
from tests.test_faults import ROOT, env, launch_two, train_args


def rows(trace_dir) -> dict[int, list[list[int]]]:
    out = {}
    for name in sorted(os.listdir(trace_dir)):
        process = int(name.removeprefix("rows_").removesuffix(".jsonl"))
        lines = (trace_dir / name).read_text().splitlines()
        out[process] = [json.loads(line) for line in lines]
    return out


@pytest.mark.slow
def test_two_processes_prepare_once_and_read_disjoint_rows(tmp_path):
    steps = 4
    single = subprocess.run(
        [sys.executable, "-m", "jaxmoe", *train_args(tmp_path / "one", tmp_path / "c1", steps)],
        cwd=ROOT,
        env={**env(), "JAXMOE_DATA_TRACE": str(tmp_path / "trace1")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert single.returncode == 0, single.stderr[-2000:]
    multi = launch_two(
        train_args(tmp_path / "two", tmp_path / "c2", steps),
        JAXMOE_DATA_TRACE=str(tmp_path / "trace2"),
    )
    log = multi.stdout + multi.stderr
    assert multi.returncode == 0, log[-3000:]
    assert log.count("data: prepared by process 0") == 1
    assert "[0] data: prepared by process 0" in log
    assert "[1] data: process 1 opens the cache prepared by process 0" in log
    assert not any(name.startswith(".tmp") for name in os.listdir(tmp_path / "c2" / "tokens"))

    reference = rows(tmp_path / "trace1")[0]
    traced = rows(tmp_path / "trace2")
    assert sorted(traced) == [0, 1] and len(reference) == steps
    for step in range(steps):
        first, second = traced[0][step], traced[1][step]
        assert len(first) == len(second) == 4
        assert not set(first) & set(second)
        assert first + second == reference[step]  # process p holds rows [4p, 4p + 4)


class Barrier:
    """Test double for the distributed barrier: records the calls, or times out."""

    def __init__(self, times_out=False):
        self.calls, self.times_out = [], times_out

    def __call__(self, name, timeout_s):
        self.calls.append((name, timeout_s))
        if self.times_out:
            raise TimeoutError(f"barrier {name!r} after {timeout_s:g}s: DEADLINE_EXCEEDED")


def test_only_process_zero_prepares(tmp_path, monkeypatch):
    from tests.test_data import make_config

    config = make_config(tmp_path / "cache", data__prepare_timeout_s=5)
    prepared, lines = [], []
    monkeypatch.setattr(multihost, "prepare", lambda data, train: prepared.append(data))
    barrier = Barrier()
    multihost.prepare_once(config.data, config.train, 1, barrier, lines.append)
    assert prepared == [] and barrier.calls == [("jaxmoe_data_prepared", 5.0)]
    assert lines == []  # nothing prepared yet: process 1 warns and prepares its own copy
    multihost.prepare_once(config.data, config.train, 0, barrier, lines.append)
    assert len(prepared) == 1 and lines[0].startswith("data: prepared by process 0")
    multihost.prepare_once(config.data, config.train, 1, barrier, lines.append)
    assert lines[1] == "data: process 1 opens the cache prepared by process 0"

    with pytest.raises(RuntimeError, match=r"process 1: .*data.prepare_timeout_s=5") as error:
        multihost.prepare_once(config.data, config.train, 1, Barrier(times_out=True), lines.append)
    assert "\n" not in str(error.value)

    # Process 0 fails: it still reaches the barrier, the others stop naming its error.
    def failing(data, train):
        raise ValueError("data.source='jsonl:/x/*.jsonl' matches no files")

    monkeypatch.setattr(multihost, "prepare", failing)
    barrier = Barrier()
    with pytest.raises(ValueError, match="matches no files"):
        multihost.prepare_once(config.data, config.train, 0, barrier, lines.append)
    assert len(barrier.calls) == 1
    with pytest.raises(RuntimeError, match=r"process 0 could not prepare the data: data\.source="):
        multihost.prepare_once(config.data, config.train, 1, barrier, lines.append)


def test_prepare_command_caches_what_train_opens(tmp_path):
    argv = ["prepare", "--config", "configs/default.py", f"--config.data.cache_dir={tmp_path}"]
    result = subprocess.run(
        [sys.executable, "-m", "jaxmoe", *argv],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "prepared 1 source(s)" in result.stdout
    tokens = sorted(os.listdir(tmp_path / "tokens"))
    assert [name.split("_")[0] for name in tokens] == ["train", "validation"]
    # Opening the data afterwards prepares nothing new.
    from tests.test_data import make_config

    config = make_config(tmp_path, data__vocab_size=1024)
    before = {p: os.stat(tmp_path / "tokens" / p).st_mtime_ns for p in tokens}
    build_data(config)
    assert sorted(os.listdir(tmp_path / "tokens")) == tokens
    assert {p: os.stat(tmp_path / "tokens" / p).st_mtime_ns for p in tokens} == before


@pytest.mark.slow
def test_stream_across_two_processes_matches_one_and_resumes_on_one(tmp_path):
    from tests.test_faults import jaxmoe, losses

    stream = ("--config.data.streaming=True", "--config.train.checkpoint_every=2")
    one = tmp_path / "one"
    result = jaxmoe(train_args(one, tmp_path / "c1", 6, *stream))
    assert result.returncode == 0, result.stderr[-2000:]
    two = tmp_path / "two"
    result = launch_two(train_args(two, tmp_path / "c2", 4, *stream))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    reference, multi = losses(one), losses(two)
    for step in range(1, 5):  # the lanes do not depend on the process count
        assert multi[step] == pytest.approx(reference[step], abs=1e-5), step
    # The 2-process checkpoint holds every lane: one process resumes it exactly.
    result = jaxmoe(train_args(two, tmp_path / "c2", 6, *stream))
    assert result.returncode == 0, result.stderr[-2000:]
    resumed = losses(two)
    for step in (5, 6):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-5), step
