"""End to end through `train()`: loss falls on the embedded corpus, resume is exact,
checkpoints carry their config, and config errors are one line naming the key."""

import json
import subprocess
import sys

import pytest

from jaxmoe.config.loading import load_config
from jaxmoe.errors import ConfigError
from jaxmoe.training.loop import train
from tests.fixtures_data import copy_data_cache
from tests.helpers import tiny_config


def read_metrics(workdir, split="train"):
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if r["split"] == split}


def run_config(cache_dir, steps, *extra):
    return tiny_config(
        "model.moe.num_experts=0",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        f"train.steps={steps}",
        "train.log_every=1",
        "train.checkpoint_every=4",
        "train.eval_every=0",
        "train.eval_batches=2",
        "optimizer.schedule=constant",
        "optimizer.warmup_steps=0",
        "optimizer.learning_rate=3e-3",
        "train.seq_len=32",
        f"data.cache_dir={cache_dir}",
        "model.vocab_size=0",
        "data.vocab_size=512",
        *extra,
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, embedded_data_cache):
    cache = copy_data_cache(embedded_data_cache, tmp_path_factory.mktemp("data") / "cache")
    workdir = tmp_path_factory.mktemp("full")
    summary = train(run_config(cache, 12), str(workdir), progress=False)
    return cache, workdir, summary


def test_loss_falls_on_embedded_corpus(uninterrupted):
    _, workdir, summary = uninterrupted
    losses = read_metrics(workdir)
    assert losses[12]["loss"] < losses[1]["loss"] - 0.5
    assert summary["eval"]["loss"] < losses[1]["loss"]
    assert {"loss", "learning_rate", "tokens_per_s", "step_time_s"} <= set(losses[5])
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["12", "4", "8"]


def test_resume_matches_uninterrupted(uninterrupted, tmp_path):
    cache, full_dir, _ = uninterrupted
    train(run_config(cache, 4), str(tmp_path), progress=False)
    summary = train(run_config(cache, 12), str(tmp_path), progress=False)
    assert summary["step"] == 12
    full, resumed = read_metrics(full_dir), read_metrics(tmp_path)
    for step in range(5, 13):
        assert resumed[step]["loss"] == pytest.approx(full[step]["loss"], abs=1e-5), step


def test_checkpoint_carries_config(uninterrupted):
    from jaxmoe.config.stored import read_config

    _, workdir, _ = uninterrupted
    stored = read_config(str(workdir))
    assert stored.model.d_model == 32 and stored.model.vocab_size == 512


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.stepz=3"], "unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
        (["train.steps=ten"], "--config.train.steps=ten: expected int"),
        (["model.num_kv_heads=3"], "model.num_heads=4 is not divisible by model.num_kv_heads=3"),
        (["model.moe.gating=top3"], "model.moe.gating='top3' is not one of"),
        (["mesh.expert=3"], "mesh.expert=3 does not divide model.moe.num_experts=8"),
        (["train.grad_accum=3"], "train.batch_size=16 is not divisible by train.grad_accum=3"),
    ],
)
def test_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config("configs/default.py", overrides)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_cli_reports_mesh_mismatch_in_one_line(tmp_path):
    """A mesh that does not match the device count fails before compiling, in one line."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxmoe",
            "train",
            "--config",
            "configs/default.py",
            "--workdir",
            str(tmp_path),
            "--config.mesh.data=3",
            "--config.mesh.fsdp=1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )
    assert result.returncode == 2
    err = result.stderr.strip().splitlines()[-1]
    assert "data*fsdp*context*tensor*expert = 3 but there are 8 devices" in err


def test_cli_rejects_unwritable_workdir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = subprocess.run(
        [sys.executable, "-m", "jaxmoe", "train", "--workdir", str(blocker / "w")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "is not writable" in result.stderr.strip().splitlines()[-1]
