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
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    """An uninterrupted 8-step run on one process with 8 devices."""
    workdir = tmp_path_factory.mktemp("reference")
    result = jaxmoe(train_args(workdir, cache, 8, "--config.train.checkpoint_every=2"))
    assert result.returncode == 0, result.stderr[-2000:]
    return losses(workdir)


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, cache, reference):
    workdir = tmp_path / "multi"
    result = subprocess.run(
        [
            "bash",
            "launch/local.sh",
            "2",
            "--devices_per_process",
            "4",
            "--",
            *train_args(workdir, cache, 5),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
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
    for step in range(kept[-1] + 1, 9):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), step
    final = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert final[-1] == 8 and set(kept) - set(final) <= {k for k in kept if k < final[0]}


@pytest.mark.slow
def test_partial_checkpoint_is_ignored(tmp_path, cache, reference):
    args = train_args(tmp_path, cache, 4, "--config.train.checkpoint_every=2")
    assert jaxmoe(args).returncode == 0
    checkpoints = tmp_path / "checkpoints"
    # What a kill during the save of step 6 leaves: Orbax's temporary directory, half written.
    partial = checkpoints / "6.orbax-checkpoint-tmp-1234567890"
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
    assert "non-finite loss" in message and "at step" in message
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
