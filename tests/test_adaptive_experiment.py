"""benchmarks/adaptive_vs_fixed.py: its arithmetic on hand-computed values, then the whole
script in --quick mode (five tiny trainings) in a fresh process."""

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "adaptive_vs_fixed.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("adaptive_vs_fixed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


avf = _load_script()


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
        model = copy.deepcopy(m)
        model.moe.gating = gating
        fixed[gating] = avf.step_flops(model, batch, length, [np.nan])[0]
    # One more expert per token: 3 matmuls D x F_e, x2 FLOPs per MAC, x3 forward + backward.
    extra = 6 * batch * length * m.num_layers * 3 * m.d_model * m.moe.ffn_dim
    assert fixed["top2"] - fixed["top1"] == pytest.approx(extra)
    flops = avf.step_flops(m, batch, length, [0.0, 0.25, 1.0])
    np.testing.assert_allclose(flops, fixed["top1"] + np.array([0.0, 0.25, 1.0]) * extra)


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("avf")
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device: the quickest compiles
    command = [sys.executable, str(SCRIPT), "--quick", "--out", str(root / "out")]
    command += ["--cache_dir", str(root / "cache")]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "out", json.loads((root / "out" / "adaptive_vs_fixed.json").read_text())


# Five tiny trainings: ~45 s of CPU time, 1.3-2 min wall on the shared 2-core machine.
@pytest.mark.slow
def test_quick_run_reports_every_variant(quick_report):
    out, report = quick_report
    variants = report["variants"]
    assert list(variants) == ["dense", "top1", "top2", "adaptive_T0.1", "adaptive_T0.2"]
    for name, r in variants.items():
        assert np.isfinite(r["final_eval_loss"]), name
        assert r["train_time_s"] > 0 and r["train_flops"] > 0, name
        assert [p["step"] for p in r["curve"]] == [2, 4], name
        markdown = (out / "adaptive_vs_fixed.md").read_text()
        assert f"| {name} |" in markdown
    assert (out / "loss_vs_time.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_quick_run_shares_and_normalisation(quick_report):
    _, report = quick_report
    v = report["variants"]
    assert v["dense"]["top2_share"] is None
    assert v["top1"]["top2_share"] == 0.0 and v["top2"]["top2_share"] == 1.0
    assert 0.0 <= v["adaptive_T0.1"]["top2_share"] <= 1.0
    assert 0.0 <= v["adaptive_T0.2"]["top2_share"] <= 1.0
    assert v["top2"]["time_vs_top2"] == 1.0 and v["top2"]["flops_vs_top2"] == 1.0
    # The default target is the worst final loss of the MoE variants: all of them reach it.
    moe = [r for name, r in v.items() if name != "dense"]
    assert report["target_loss"] == max(r["final_eval_loss"] for r in moe)
    for r in moe:
        assert r["time_to_target_s"] <= r["train_time_s"] + 1e-9
        assert r["flops_to_target"] <= r["train_flops"] * (1 + 1e-9)
    # Adaptive work lies between top-1's and top-2's.
    assert v["top1"]["train_flops"] <= v["adaptive_T0.1"]["train_flops"] <= v["top2"]["train_flops"]
    assert v["top1"]["train_flops"] < v["top2"]["train_flops"]
