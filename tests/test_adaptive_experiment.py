"""experiments.adaptive_vs_fixed: its arithmetic on hand-computed values, then the whole
script in --quick mode (five tiny trainings) in a fresh process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import adaptive_vs_fixed as avf
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def test_reach_interpolates_between_evaluations():
    steps, losses = [2, 4, 6], [5.0, 4.0, 3.0]
    one_per_step = np.arange(7.0)  # cumulative cost of steps 0..6
    assert avf.reach(steps, losses, one_per_step, 3.5) == (5.0, 5.0)
    assert avf.reach(steps, losses, one_per_step, 6.0) == (2.0, 2.0)  # at the first eval
    assert avf.reach(steps, losses, one_per_step, 2.9) is None
    uneven = np.array([0.0, 10, 11, 12, 13, 14, 15])
    assert avf.reach(steps, losses, uneven, 4.5) == (3.0, 12.0)
    assert avf.reach(steps, losses, uneven, 4.75) == (2.5, 11.5)
    # A loss that rises again: the first crossing counts.
    assert avf.reach([1, 2, 3], [2.0, 1.0, 3.0], np.arange(4.0), 1.5) == (1.5, 1.5)


def test_noisy_steps_take_the_median_of_the_others():
    times = np.array([10.0, 1.0, 2.0, 7.0, 3.0])
    noisy = np.array([True, False, False, True, False])
    np.testing.assert_allclose(avf.clean_step_times(times, noisy), [2.0, 1.0, 2.0, 2.0, 3.0])


def test_adaptive_flops_follow_the_measured_share():
    config = tiny_config("model.moe.gating=adaptive")
    m, batch, length = config.model, 8, 16
    fixed = {}
    for gating in ("top1", "top2"):
        model = m.replace(moe=m.moe.replace(gating=gating))
        fixed[gating] = avf.step_flops(model, batch, length, [np.nan])[0]
    # One more expert per token: 3 matmuls D x F_e, x2 FLOPs per MAC, x3 forward + backward.
    extra = 6 * batch * length * m.num_layers * 3 * m.d_model * m.moe.ffn_dim
    assert fixed["top2"] - fixed["top1"] == pytest.approx(extra)
    flops = avf.step_flops(m, batch, length, [0.0, 0.25, 1.0])
    np.testing.assert_allclose(flops, fixed["top1"] + np.array([0.0, 0.25, 1.0]) * extra)


def test_paper_model_moe_share_by_hand():
    """The paper setting's model: MoE FFNs are most of a step's FLOPs, by hand."""
    args = avf.parse_args(["--out", "unused"])
    config = avf.variant_config("top1", args, seed=0)
    config = config.replace(model=config.model.replace(vocab_size=1024))
    router, expert = 128 * 8, 3 * 128 * 512  # per token per layer: D x E, gated FFN D x F
    attention = 2 * 128 * 128 + 2 * 128 * 64 + 2 * 4 * 32 * 128  # projections, QK^T + PV
    total = 2 * (router + expert + attention) + 128 * 1024  # 2 layers + output layer
    share = avf.moe_flops_share(config.model, 16, 128)
    assert share == pytest.approx(2 * (router + expert) / total)
    assert share > 0.5
    config = config.replace(model=config.model.replace(moe=config.model.moe.replace(gating="top2")))
    total2 = total + 2 * expert
    assert avf.moe_flops_share(config.model, 16, 128) == pytest.approx(
        2 * (router + 2 * expert) / total2
    )


def test_paper_variants_follow_the_paper():
    args = avf.parse_args(["--out", "unused"])
    assert args.seeds == [0, 1, 2] and args.variants == [
        "dense",
        "dense_x2",
        "top1",
        "top2",
        "adaptive_T0.1",
    ]
    cfg = {name: avf.variant_config(name, args, seed=1) for name in avf.all_variants("paper")}
    assert cfg["dense"].model.ffn_dim == cfg["top2"].model.moe.ffn_dim  # one expert's width
    assert cfg["dense_x2"].model.ffn_dim == 2 * cfg["top2"].model.moe.ffn_dim
    assert cfg["dense"].model.moe.num_experts == 0
    adaptive = cfg["adaptive_T0.1"]
    assert adaptive.data.curriculum == "paper" and adaptive.model.moe.gate.threshold == 0.1
    assert cfg["adaptive_T0.1_no_curriculum"].data.curriculum == "none"
    assert cfg["top2"].data.curriculum == "none"
    assert cfg["top2"].model.moe.balance_fractions == "top1"  # GShard's implementation
    for name, c in cfg.items():
        assert c.model.moe.eval_gating == "top1" and c.model.moe.z_loss_weight == 0, name
        assert c.train.seed == 1 and c.train.steps == 312, name


def test_unknown_variant_names_the_choices(capsys):
    with pytest.raises(SystemExit):
        avf.parse_args(["--out", "x", "--setting", "plain", "--variants", "dense_x2"])
    assert "unknown ['dense_x2'] for --setting plain" in capsys.readouterr().err


def test_summary_is_mean_and_sample_std_over_seeds():
    def row(loss, ratio):
        return {"final_eval_loss": loss, "time_vs_top2": ratio, "steps_to_target": 1.0}

    per_seed = {
        0: {"variants": {"a": row(3.0, 0.8), "b": row(2.0, None) | {"steps_to_target": None}}},
        1: {"variants": {"a": row(4.0, 1.0), "b": row(2.5, None) | {"steps_to_target": None}}},
        2: {"variants": {"a": row(5.0, 0.9), "b": row(3.0, None) | {"steps_to_target": None}}},
    }
    summary = avf.summarize(per_seed)
    assert summary["a"]["final_eval_loss"]["mean"] == pytest.approx(4.0)
    assert summary["a"]["final_eval_loss"]["std"] == pytest.approx(1.0)  # sqrt(2 / 2)
    assert summary["a"]["time_vs_top2"]["std"] == pytest.approx(0.1)
    assert summary["b"]["reached"] == 0 and summary["b"]["seeds"] == 3
    assert summary["b"]["time_vs_top2"] == {"mean": None, "std": None, "values": []}


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("avf")
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device: the quickest compiles
    # Run from a scratch directory: the checkout on the path is where `benchmarks` lives.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "experiments", "adaptive_vs_fixed", "--quick"]
    command += ["--out", str(root / "out")]
    command += ["--cache_dir", str(root / "cache"), "--seeds", "0,1"]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "out", json.loads((root / "out" / "adaptive_vs_fixed.json").read_text())


MAIN = ["dense", "dense_x2", "top1", "top2", "adaptive_T0.1"]


# Ten tiny trainings and the interleaved timing: ~45 s of CPU time, 7.5 min wall on
# the shared 2-core machine at load 15.
@pytest.mark.slow
def test_quick_run_reports_every_variant(quick_report):
    out, report = quick_report
    assert list(report["seeds"]) == ["0", "1"]
    assert list(report["summary"]) == MAIN
    for seed in report["seeds"].values():
        assert list(seed["variants"]) == MAIN
        for name, r in seed["variants"].items():
            assert np.isfinite(r["final_eval_loss"]), name
            assert r["train_time_s"] > 0 and r["train_flops"] > 0, name
            assert [p["step"] for p in r["curve"]] == [2, 4], name
    markdown = (out / "adaptive_vs_fixed.md").read_text()
    for name in MAIN:
        assert f"| {name} |" in markdown
    assert (out / "loss_vs_time.png").read_bytes()[:4] == b"\x89PNG"
    times = report["step_times"]["variants"]
    assert list(times) == MAIN and times["top2"]["step_time_vs_top2"] == 1.0
    assert all(t["median_step_s"] > 0 for t in times.values())


@pytest.mark.slow
def test_quick_run_shares_targets_and_spread(quick_report):
    _, report = quick_report
    for seed in report["seeds"].values():
        v = seed["variants"]
        assert v["dense"]["top2_share"] is None
        assert v["top1"]["top2_share"] == 0.0 and v["top2"]["top2_share"] == 1.0
        assert 0.0 <= v["adaptive_T0.1"]["top2_share"] <= 1.0
        assert v["top2"]["time_vs_top2"] == 1.0 and v["top2"]["flops_vs_top2"] == 1.0
        # The target is the worst final loss of the main MoE variants: all of them reach it.
        moe = [v[name] for name in ("top1", "top2", "adaptive_T0.1")]
        assert seed["target_loss"] == max(r["final_eval_loss"] for r in moe)
        for r in moe:
            assert r["time_to_target_s"] <= r["train_time_s"] + 1e-9
            assert r["flops_to_target"] <= r["train_flops"] * (1 + 1e-9)
        # Evaluated with top-1 as the paper; the training gate's loss is reported beside it.
        assert v["top1"]["final_eval_loss_train_gate"] == v["top1"]["final_eval_loss"]
        for name in ("top2", "adaptive_T0.1"):
            assert v[name]["eval_gating"] == "top1"
            assert np.isfinite(v[name]["final_eval_loss_train_gate"]), name
        # Adaptive work lies between top-1's and top-2's.
        flops = [v[name]["train_flops"] for name in ("top1", "adaptive_T0.1", "top2")]
        assert flops[0] <= flops[1] <= flops[2] and flops[0] < flops[2]
    losses = [s["variants"]["top1"]["final_eval_loss"] for s in report["seeds"].values()]
    summary = report["summary"]["top1"]["final_eval_loss"]
    assert summary["mean"] == pytest.approx(np.mean(losses))
    assert summary["std"] == pytest.approx(np.std(losses, ddof=1))
