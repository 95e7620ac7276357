"""The straggler simulation's arithmetic and the time-to-target rule, against hand-computed
values (experiments/stragglers.py, experiments/time_to_target.py)."""

import json

import numpy as np
import pytest

from experiments import stragglers
from experiments.time_to_target import target_from_pilot

# 4 examples, 2 MoE layers: per-layer fractions of their tokens sent to two experts.
TOP2_NM = np.array([[0.0, 0.0], [1.0, 1.0], [0.5, 0.0], [0.0, 0.5]])


def test_step_is_the_slowest_device_by_hand():
    # time(f) = 1 + f per layer. Step 1: device 0 holds example 0 (1 + 1 = 2), device 1
    # example 1 (2 + 2 = 4): the step takes 4, the mean device 3. Step 2: examples 2 and
    # 3, 1.5 + 1 = 2.5 each.
    got = stragglers.simulate_steps(
        [0, 1, 2, 3], TOP2_NM, np.ones(4), 2, 1, stragglers.linear_time(1.0, 1.0)
    )
    np.testing.assert_allclose(got["step"], [4.0, 2.5])
    np.testing.assert_allclose(got["mean_device"], [3.0, 2.5])


def test_shard_share_is_token_weighted_and_incomplete_steps_drop():
    # One device, two examples of 1 and 3 tokens: layer 0 (0 * 1 + 1 * 3) / 4 = 0.75, layer 1
    # likewise 0.75; time 2 * (0.5 + 2 * 0.75) = 4. The fifth id makes no full step.
    tokens = np.array([1.0, 3.0, 1.0, 1.0])
    np.testing.assert_allclose(
        stragglers.shard_shares(TOP2_NM, tokens, np.array([[0, 1]])), [[0.75, 0.75]]
    )
    got = stragglers.simulate_steps(
        [0, 1, 2], TOP2_NM, tokens, 1, 2, stragglers.linear_time(0.5, 2.0)
    )
    np.testing.assert_allclose(got["step"], [4.0])
    with pytest.raises(ValueError, match="no step of 4 devices"):
        stragglers.simulate_steps([0, 1], TOP2_NM, tokens, 4, 1, stragglers.linear_time(1, 1))


def test_curves_fit_and_interpolate():
    assert stragglers.fit_line([0.0, 0.5, 1.0], [0.6, 0.8, 1.0]) == pytest.approx((0.6, 0.4))
    paper = stragglers.table_time(
        stragglers.PAPER_CURVE["top2_share"], stragglers.PAPER_CURVE["time"]
    )
    # Halfway between the paper's 20% (0.76) and 50% (0.92) top-2 rows.
    assert float(paper(0.35)) == pytest.approx(0.84)


def test_epoch_vectors_split_a_record_by_epoch():
    record = {
        "step": np.array([1, 2, 3]),  # 2 steps per epoch: steps 1-2 epoch 0, step 3 epoch 1
        "example_ids": np.array([[0, 1], [2, 3], [1, 0]]),
        "top2_BM": np.arange(12, dtype=np.float32).reshape(3, 2, 2) / 12,
    }
    top2, seen = stragglers.epoch_vectors(record, 1, 4, 2)
    np.testing.assert_array_equal(seen, [True, True, False, False])
    np.testing.assert_allclose(top2[0], np.array([10, 11]) / 12)
    np.testing.assert_allclose(top2[1], np.array([8, 9]) / 12)


def test_sorted_order_has_no_stragglers_when_complexity_persists():
    # Complexities that repeat from epoch to epoch: ordering by the previous epoch's
    # magnitude puts alike examples in a step, so its steps are no slower than shuffled ones.
    rng = np.random.default_rng(0)
    n, spe = 64, 4  # 16 examples a step
    levels = rng.uniform(0, 1, n)
    ids = np.concatenate([rng.permutation(n), rng.permutation(n)]).reshape(2 * spe, 16)
    record = {
        "step": np.arange(1, 2 * spe + 1),
        "example_ids": ids,
        "top2_BM": np.repeat(levels[ids][..., None], 2, axis=-1).astype(np.float32),
    }
    curve = {"linear": stragglers.linear_time(1.0, 1.0)}
    got = stragglers.simulate_seed(record, 0, spe, [4], 2, curve, shuffles=3)
    row = got["linear"][4]
    assert row["magnitude"]["step"] < row["none"]["step"]
    assert got["examples"] == n and got["epoch0_vs_epoch1_correlation"] == pytest.approx(1.0)


def test_target_rule_by_hand():
    # 95% of a drop from 7.0 to 3.0 is 3.8: the target is 7.0 - 3.8 = 3.2.
    assert target_from_pilot(7.0, 3.0, 0.95) == pytest.approx(3.2)
    with pytest.raises(ValueError, match="target_fraction"):
        target_from_pilot(7.0, 3.0, 1.5)


def test_main_on_a_recorded_run(tmp_path, capsys):
    # Two epochs of 4 steps x 16 examples of one seed, in the layout time_to_target writes.
    rng = np.random.default_rng(1)
    ids = np.concatenate([rng.permutation(64), rng.permutation(64)]).reshape(8, 16)
    levels = rng.uniform(0, 0.5, (64, 2)).astype(np.float32)
    path = tmp_path / "routing.npz"
    np.savez(
        path,
        **{
            "seed0/adaptive_T0.1/step": np.arange(1, 9),
            "seed0/adaptive_T0.1/example_ids": ids,
            "seed0/adaptive_T0.1/top2_BM": levels[ids],
            "seed0/steps_per_epoch": np.asarray(4),
            "seq_len": np.asarray(64),
        },
    )
    stragglers.main(["--routing", str(path), "--curve", "none", "--devices", "2,4", "--json", "-"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    row = result["summary"]["paper Table 1"]["4"]
    # The slowest device is never faster than the mean one.
    assert row["none"] >= row["balanced"] and row["steps"] == 8
