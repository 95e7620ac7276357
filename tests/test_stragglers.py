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


# Expert parallelism: 2 examples, 1 MoE layer, 4 experts in 2 groups (experts 0-1, 2-3).
ROWS_BME = np.array([[[3, 1, 0, 2]], [[1, 1, 4, 0]]])


def test_expert_group_rows_and_wait_by_hand():
    # Group 0 receives 3 + 1 + 1 + 1 = 6 rows, group 1 0 + 2 + 4 + 0 = 6: balanced, no wait.
    np.testing.assert_array_equal(stragglers.group_rows(ROWS_BME, 2), [[6, 6]])
    # Only example 0: group 0 gets 4 rows, group 1 2; the step waits for 4, group 1 waits 2.
    got = stragglers.ep_step_rows(ROWS_BME[:1], 2)
    assert got["critical"] == 4 and got["balanced"] == 3
    np.testing.assert_array_equal(got["wait_G"], [0, 2])
    with pytest.raises(ValueError, match="4 experts do not split into 3"):
        stragglers.group_rows(ROWS_BME, 3)


def ep_record(rows_NME, ids_SB, top2_NM):
    """steps.npz of experiments/ep_worker.py for example ids in this order, as its driver
    reads it (step numbers and top2_BM added)."""
    return {
        "step": np.arange(1, len(ids_SB) + 1),
        "example_ids": ids_SB,
        "top2_BM": top2_NM[ids_SB],
        "rows_MBE": rows_NME[ids_SB].transpose(0, 2, 1, 3),
    }


def test_epoch_rows_and_correlations_from_a_record():
    # 4 examples, batch 2, 2 steps an epoch, 2 epochs; example n routes n rows to expert 0.
    rows_NME = np.zeros((4, 1, 2), np.int16)
    rows_NME[:, 0, 0] = np.arange(4)
    top2_NM = np.array([[0.1], [0.4], [0.2], [0.3]], np.float32)
    record = ep_record(rows_NME, np.array([[0, 1], [2, 3], [3, 2], [1, 0]]), top2_NM)
    rows, seen = stragglers.epoch_rows(record, 1, 4, 2)
    assert seen.all() and rows[3, 0, 0] == 3 and rows[1, 0, 0] == 1
    # The same vectors in both epochs: r = 1.
    (corr,) = stragglers.epoch_correlations(record, 2)
    assert corr["epochs"] == [0, 1] and corr["examples"] == 4
    assert corr["vectors_r"] == pytest.approx(1.0) and corr["means_r"] == pytest.approx(1.0)
    assert corr["within_layer_r"] == pytest.approx(1.0)


def test_a_curriculum_that_groups_alike_examples_makes_expert_groups_wait():
    # Half the examples send their 10 rows to group 0, half to group 1, every epoch alike,
    # and the complexity vector tells the two kinds apart. Under expert parallelism the
    # magnitude order, which puts alike examples in one step, loads one group per step (the
    # other waits for all 80 rows), while a shuffled step splits its rows between the groups.
    n, batch = 32, 8
    rows_NME = np.zeros((n, 1, 2), np.int16)
    rows_NME[: n // 2, 0, 0] = 10
    rows_NME[n // 2 :, 0, 1] = 10
    top2_NM = np.where(np.arange(n) < n // 2, 0.1, 0.9).astype(np.float32)[:, None]
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.permutation(n), rng.permutation(n)]).reshape(-1, batch)
    record = ep_record(rows_NME, ids, top2_NM)
    sim = stragglers.simulate_ep_epoch(record, 1, n // batch, 0, batch, 2, shuffles=20)
    # Sorted by magnitude: steps of 8 one-sided examples, 80 rows on one group, 0 on the other.
    assert sim["magnitude"]["critical_rows"] == pytest.approx(80.0)
    assert sim["magnitude"]["wait_rows"] == pytest.approx(40.0)
    assert sim["none"]["balanced_rows"] == pytest.approx(40.0)
    assert 40.0 < sim["none"]["critical_rows"] < 80.0
