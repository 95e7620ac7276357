"""Fault tolerance through the real CLI: multi-process equivalence, SIGKILL, a kill during a
checkpoint write, SIGTERM preemption and a non-finite loss."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures_data import copy_data_cache

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--config",
    "configs/default.py:dense",
    "--no_progress",
    "--config.model.num_layers=2",
    "--config.model.d_model=32",
    "--config.model.num_heads=4",
    "--config.model.num_kv_heads=2",
    "--config.model.head_dim=8",
    "--config.model.ffn_dim=64",
    "--config.train.batch_size=8",
    "--config.train.seq_len=32",
    "--config.train.log_every=1",
    "--config.train.eval_batches=1",
    "--config.train.eval_every=0",
    "--config.optimizer.schedule=constant",
    "--config.optimizer.warmup_steps=0",
    "--config.data.vocab_size=512",
]


def env(devices: int = 8) -> dict:
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
    }


def jaxmoe(args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "jaxmoe", *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
        **kwargs,
    )


def losses(workdir: Path) -> dict[int, float]:
    out = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] == "train":
            out[record["step"]] = record["loss"]
    return out


def train_args(workdir, cache, steps, *extra):
    return [
        "train",
        "--workdir",
        str(workdir),
        *TINY,
        f"--config.train.steps={steps}",
        f"--config.data.cache_dir={cache}",
        *extra,
    ]


@pytest.fixture(scope="module")
def cache(tmp_path_factory, embedded_data_cache):
    return copy_data_cache(embedded_data_cache, tmp_path_factory.mktemp("data") / "cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    """An uninterrupted 8-step run on one process with 8 devices."""
    workdir = tmp_path_factory.mktemp("reference")
    result = jaxmoe(train_args(workdir, cache, 8, "--config.train.checkpoint_every=2"))
    assert result.returncode == 0, result.stderr[-2000:]
    return losses(workdir)


def launch_two(args, **extra_env):
    """`launch/local.sh 2 --devices_per_process 4 -- ARGS`: 2 processes x 4 CPU devices."""
    return subprocess.run(
        ["bash", "launch/local.sh", "2", "--devices_per_process", "4", "--", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, **extra_env},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, cache, reference):
    workdir = tmp_path / "multi"
    result = launch_two(train_args(workdir, cache, 5))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    multi = losses(workdir)
    for step in range(1, 6):
        assert multi[step] == pytest.approx(reference[step], abs=1e-5), step


def wait_for_step(workdir: Path, step: int, process, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"run ended early: {process.stderr.read()[-2000:]}")
        metrics = workdir / "metrics.jsonl"
        if metrics.exists() and any(s >= step for s in losses(workdir)):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


def start(args):
    return subprocess.Popen(
        [sys.executable, "-m", "jaxmoe", *args],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, cache, reference):
    args = train_args(tmp_path, cache, 8, "--config.train.checkpoint_every=2")
    process = start(args)
    wait_for_step(tmp_path, 5, process)
    process.kill()
    process.wait()
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert kept and kept[-1] >= 2
    result = jaxmoe(args)
    assert result.returncode == 0, result.stderr[-2000:]
    resumed = losses(tmp_path)  # later lines for a step overwrite the killed run's
    compared = range(kept[-1] + 1, 9)
    assert len(compared) >= 2, f"killed too late to test a resume: checkpoints {kept}"
    for step in compared:
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), step
    final = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert final[-1] == 8 and set(kept) - set(final) <= {k for k in kept if k < final[0]}


@pytest.mark.slow
def test_partial_checkpoint_is_ignored(tmp_path, cache, reference):
    args = train_args(tmp_path, cache, 4, "--config.train.checkpoint_every=2")
    assert jaxmoe(args).returncode == 0
    checkpoints = tmp_path / "checkpoints"
    # What a kill during the save of step 6 leaves: Orbax's temporary directory, half written.
    partial = checkpoints / "6.orbax-checkpoint-tmp"  # the name Orbax gives it
    shutil.copytree(checkpoints / "4", partial)
    for file in sorted(partial.rglob("*"))[::2]:
        if file.is_file():
            file.write_bytes(file.read_bytes()[: len(file.read_bytes()) // 2])
    result = jaxmoe(train_args(tmp_path, cache, 8, "--config.train.checkpoint_every=2"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ignoring partial checkpoint" in result.stderr
    resumed = losses(tmp_path)
    for step in range(5, 9):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), step


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero(tmp_path, cache, reference):
    args = train_args(tmp_path, cache, 400, "--config.train.checkpoint_every=1000")
    process = start(args)
    wait_for_step(tmp_path, 3, process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-2000:]
    saved = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(saved) == 1 and 3 <= saved[0] < 400
    result = jaxmoe(train_args(tmp_path, cache, saved[0] + 2))
    assert result.returncode == 0, result.stderr[-2000:]
    assert max(losses(tmp_path)) == saved[0] + 2


@pytest.mark.slow  # two CLI runs saving every step: 210 s wall, loaded host, cold cache
def test_nonfinite_loss_stops_and_keeps_last_checkpoint(tmp_path, cache):
    args = train_args(
        tmp_path,
        cache,
        6,
        "--config.train.checkpoint_every=1",
        "--config.optimizer.learning_rate=1e30",
        "--config.optimizer.grad_clip_norm=0.0",
    )
    result = jaxmoe(args)
    assert result.returncode == 2
    message = result.stderr.strip().splitlines()[-1]
    # lr 1e30 blows the parameters up: the next gradient is NaN while the loss is finite.
    assert "non-finite gradient" in message and "at step" in message
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    bad_step = int(message.split("at step ")[1].split(";")[0])
    assert saved and max(saved) < bad_step

    skip = jaxmoe(
        train_args(
            tmp_path / "skip",
            cache,
            4,
            "--config.train.nonfinite=skip",
            "--config.optimizer.learning_rate=1e30",
            "--config.optimizer.grad_clip_norm=0.0",
        )
    )
    assert skip.returncode == 0, skip.stderr[-2000:]


def _steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _in_flight(workdir: Path) -> list[Path]:
    return [p for p in (workdir / "checkpoints").iterdir() if "orbax-checkpoint-tmp" in p.name]


@pytest.mark.slow
def test_sigkill_during_a_save_loses_no_completed_checkpoint(tmp_path, cache, reference):
    """Kill -9 while Orbax writes a step (its temporary directory exists, the step before is
    committed), then resume: the run continues from the committed step, bit for bit."""
    args = train_args(tmp_path, cache, 8, "--config.train.checkpoint_every=2")
    for _attempt in range(5):
        shutil.rmtree(tmp_path, ignore_errors=True)
        tmp_path.mkdir()
        process = start(args)
        deadline = time.monotonic() + 300
        while process.poll() is None and time.monotonic() < deadline:
            if (tmp_path / "checkpoints").exists() and _steps(tmp_path) and _in_flight(tmp_path):
                process.kill()
                break
            time.sleep(0.001)
        process.wait()
        if _in_flight(tmp_path) and _steps(tmp_path) and _steps(tmp_path)[-1] < 8:
            break  # the kill landed inside a save
    else:
        pytest.fail("could not kill the trainer during a checkpoint save in 5 attempts")
    kept = _steps(tmp_path)
    result = jaxmoe(args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    resumed = losses(tmp_path)
    assert f"starting at step {kept[-1]} of 8" in result.stdout  # the last committed step
    for step in range(kept[-1] + 1, 9):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), step


def _truncate_params(step_dir: Path) -> None:
    """Cut every OCDBT `d/` file of the params item (array data and B-tree index nodes) to 100
    bytes, as a crash mid-copy would. Which file holds what depends on the run (in one CI run
    the largest file was the index), so all of them are cut."""
    data = [p for p in (step_dir / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data, "no OCDBT data files: Orbax changed its layout?"
    for victim in data:
        with victim.open("r+b") as handle:
            handle.truncate(100)


@pytest.mark.slow
def test_damaged_latest_checkpoint_falls_back_with_one_warning(tmp_path, cache, reference):
    args4 = train_args(tmp_path, cache, 4, "--config.train.checkpoint_every=2")
    assert jaxmoe(args4).returncode == 0
    _truncate_params(tmp_path / "checkpoints" / "4")

    evaluate = jaxmoe(["eval", "--checkpoint", str(tmp_path), "--data", "embedded"])
    lines = evaluate.stderr.strip().splitlines()
    assert evaluate.returncode == 2 and len(lines) == 1, evaluate.stderr[-3000:]
    assert "is damaged" in lines[0] and str(tmp_path / "checkpoints" / "4" / "params") in lines[0]

    result = jaxmoe(train_args(tmp_path, cache, 8, "--config.train.checkpoint_every=2"))
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [line for line in result.stderr.splitlines() if "is damaged" in line]
    assert len(warnings) == 1 and "checkpoint step 4" in warnings[0], result.stderr[-2000:]
    assert (tmp_path / "checkpoints" / "4.damaged").is_dir()  # kept for inspection
    resumed = losses(tmp_path)
    for step in range(3, 9):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), step

    # A step whose meta item is missing is damaged too.
    shutil.rmtree(tmp_path / "checkpoints" / "8" / "meta")
    again = jaxmoe(train_args(tmp_path, cache, 8, "--config.train.checkpoint_every=2"))
    assert again.returncode == 0, again.stderr[-2000:]
    assert "checkpoint step 8 is damaged" in again.stderr

    # A readable checkpoint of another model is no damage: resuming with a changed width
    # stops with one line and sets nothing aside (it would silently restart at step 0).
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    wider = jaxmoe(train_args(tmp_path, cache, 10, "--config.model.ffn_dim=128"))
    lines = wider.stderr.strip().splitlines()
    assert wider.returncode == 2 and len(lines) == 1, wider.stderr[-2000:]
    assert "layers.0.ffn.wi_0 has shape (32, 64)" in lines[0] and "(32, 128)" in lines[0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_two_trainers_on_one_workdir(tmp_path, cache):
    args = train_args(tmp_path, cache, 100000, "--config.train.checkpoint_every=2")
    first = start(args)
    try:
        wait_for_step(tmp_path, 3, first)
        second = jaxmoe(args)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-2000:]
        assert "in use by another jaxmoe train" in lines[0] and f"pid {first.pid}" in lines[0]
    finally:
        first.kill()
        first.wait()
    saved = _steps(tmp_path)
    assert saved, "the first run saved nothing before it was killed"
    # The killed run's lock is taken over; its completed checkpoints are all still there.
    third = jaxmoe(train_args(tmp_path, cache, saved[-1] + 1))
    assert third.returncode == 0, third.stderr[-2000:]
    assert "taking over the lock" in third.stderr
    assert f"starting at step {saved[-1]} of" in third.stdout  # its newest checkpoint restored
