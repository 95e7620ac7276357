"""The trainer shows where its time goes: a profile of chosen steps, MFU on train lines,
a goodput summary, and Weights & Biases logging (offline)."""

import json

import pytest

from jaxmoe.config.loading import load_config
from jaxmoe.errors import ConfigError
from jaxmoe.training.loop import train
from jaxmoe.training.profiling import parse_profile_steps
from tests.fixtures_data import copy_data_cache
from tests.helpers import tiny_config

PEAK = 1e11  # FLOP/s per device, as if this CPU had a known peak


def hand_flops_per_step(batch=8, length=32, layers=2, d=32, heads=4, kv=2, hd=8, ffn=64, vocab=512):
    """PaLM-style model FLOPs, written out for this dense decoder: 2 FLOPs per multiply-add,
    x3 for forward + backward; projections, gated FFN, scores over all keys, output layer."""
    projections = 2 * d * heads * hd + 2 * d * kv * hd
    gated_ffn = 3 * d * ffn
    scores = 2 * heads * hd * length * length  # QK^T and PV, one sequence
    per_sequence = length * (layers * (projections + gated_ffn) + d * vocab) + layers * scores
    return 6 * per_sequence * batch


@pytest.fixture(scope="module")
def run(tmp_path_factory, monkeypatch_module, embedded_data_cache):
    monkeypatch_module.setenv("WANDB_MODE", "offline")
    monkeypatch_module.setenv("WANDB_SILENT", "true")
    workdir = tmp_path_factory.mktemp("observed")
    cache = tmp_path_factory.mktemp("data") / "cache"
    config = tiny_config(
        "model.moe.num_experts=0",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "train.steps=6",
        "train.log_every=1",
        "train.checkpoint_every=3",
        "train.eval_every=3",
        "train.eval_batches=1",
        "train.seq_len=32",
        "train.profile_steps=2:4",
        f"train.peak_flops={PEAK}",
        "train.wandb=jaxmoe-test/observed",
        f"data.cache_dir={copy_data_cache(embedded_data_cache, cache)}",
        "model.vocab_size=0",
        "data.vocab_size=512",
    )
    summary = train(config, str(workdir), progress=False)
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return workdir, summary, records


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_mfu_is_model_flops_over_peak(run):
    _, _, records = run
    train_lines = [r for r in records if r["split"] == "train"]
    assert len(train_lines) == 6
    for line in train_lines:
        expected = hand_flops_per_step() / (line["step_time_s"] * PEAK * 8)
        assert line["mfu"] == pytest.approx(expected, rel=1e-6)


def test_goodput_accounts_for_the_wall_time(run):
    _, _, records = run
    (line,) = [r for r in records if r["split"] == "goodput"]
    spent = line["goodput"]
    parts = ("step_s", "compile_s", "data_s", "checkpoint_s", "eval_s", "other_s")
    assert sum(spent[p] for p in parts) == pytest.approx(spent["wall_s"], rel=1e-6)
    assert spent["compile_s"] > 0 and spent["checkpoint_s"] > 0 and spent["eval_s"] > 0
    assert spent["goodput"] == pytest.approx(spent["step_s"] / spent["wall_s"])
    assert 0 < spent["goodput"] < 1


def test_profile_of_the_chosen_steps_is_written(run):
    workdir, _, _ = run
    traces = list((workdir / "profile").rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0


def test_wandb_offline_run_has_the_scalars(run):
    workdir, _, _ = run
    files = list((workdir / "wandb").rglob("*.wandb"))
    assert files, list((workdir / "wandb").rglob("*"))
    content = b"".join(f.read_bytes() for f in files)
    assert b"train/loss" in content and b"train/mfu" in content and b"eval/loss" in content


@pytest.mark.parametrize("text", ["5", "5:5", "a:b", "-1:3", "3:1"])
def test_bad_profile_steps_is_one_line(text):
    with pytest.raises(ValueError, match=r"train\.profile_steps"):
        parse_profile_steps(text)
    with pytest.raises(ConfigError, match=r"train\.profile_steps"):
        load_config("configs/default.py", [f"--config.train.profile_steps={text}"])
