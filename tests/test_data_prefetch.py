"""Prefetching: the same batches as building them on the spot, and states that name the
last batch handed out (not the ones queued), so resume is unchanged."""

import numpy as np
import pytest

from jaxmoe.data import pipeline
from jaxmoe.data.prefetch import Prefetch
from tests.fixtures_data import build_data
from tests.test_data import make_config
from tests.test_data_mixture import mixture


def ids(batches, n):
    return [next(batches)["example_ids"].tolist() for _ in range(n)]


def test_prefetch_yields_the_same_batches_and_exact_states():
    plain = mixture([50, 20], [0.6, 0.4], batch_size=8)
    expected, states = [], []
    for _ in range(30):
        expected.append(next(plain)["example_ids"].tolist())
        states.append(plain.get_state())
    ahead = Prefetch(mixture([50, 20], [0.6, 0.4], batch_size=8), depth=4)
    assert ids(ahead, 10) == expected[:10]
    assert ahead.get_state() == states[9]  # not the state of the batches queued behind
    ahead.set_state(states[4])
    assert ids(ahead, 25) == expected[5:30]
    ahead.close()
    assert ahead.get_state() == states[29]


def test_an_error_while_building_reaches_the_training_loop():
    class Failing:
        def __init__(self):
            self.n = 0

        def __next__(self):
            self.n += 1
            if self.n == 3:
                raise ValueError("bad record")
            return {"example_ids": np.array([self.n])}

        def get_state(self):
            return {"n": self.n}

        def set_state(self, state):
            self.n = state["n"]

    ahead = Prefetch(Failing(), depth=2)
    assert ids(ahead, 2) == [[1], [2]]
    with pytest.raises(ValueError, match="bad record"):
        next(ahead)


def test_build_data_prefetches_unless_told_not_to(tmp_path):
    on = build_data(make_config(tmp_path))
    config = make_config(tmp_path, data__prefetch=0)
    off = build_data(config)
    assert isinstance(on.train, Prefetch) and isinstance(off.train, pipeline.TrainBatches)
    assert ids(on.train, 5) == ids(off.train, 5)
    assert on.train.get_state() == off.train.get_state()


def test_data_wait_benchmark_runs(tmp_path, capsys):
    from benchmarks import data_wait as module

    rows = module.main(["--steps", "5", "--step_ms", "1", f"--config.data.cache_dir={tmp_path}"])
    assert [(r["objective"], r["prefetch"], r["workers"]) for r in rows] == [
        ("lm", 0, 0),
        ("lm", 2, 0),
    ]
    assert all(r["wait_s"] >= 0 and 0 <= r["share"] < 1 for r in rows)
    assert "lm: data.prefetch=2 data.workers=0: waits" in capsys.readouterr().out
