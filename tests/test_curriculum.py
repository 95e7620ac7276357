"""Routing-complexity curriculum: ordering policies against hand-worked orders, the on-disk
store against hand-computed overlays, the loader's coverage per epoch, and `train()` with
`data.curriculum=paper` end to end (resume equals an uninterrupted run)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxmoe.data import curriculum
from jaxmoe.data.complexity_store import ComplexityStore
from jaxmoe.data.pipeline import default_epoch_order
from tests.fixtures_data import build_data, train_batches

ROOT = Path(__file__).resolve().parents[1]

# --- ordering policies: hand-worked --------------------------------------------------


def rank(policy, vectors, seen, tie_order):
    return curriculum.rank_seen(
        policy, np.asarray(vectors, np.float32), np.asarray(seen, bool), np.asarray(tie_order)
    ).tolist()


def test_magnitude_ascending_with_ties_in_tie_order():
    # means: 0.5, 0.2, 0.0, 0.2, 0.5 (in float32 0.1 + 0.3 and 0.2 + 0.2 differ by 4e-9)
    vectors = [[0.5, 0.5], [0.1, 0.3], [0.0, 0.0], [0.2, 0.2], [0.9, 0.1]]
    assert rank("magnitude", vectors, [True] * 5, [4, 3, 2, 1, 0]) == [2, 3, 1, 4, 0]
    assert rank("magnitude", vectors, [True] * 5, [0, 1, 2, 3, 4]) == [2, 1, 3, 0, 4]


def test_paper_cosine_to_least_complex_example():
    # Reference: id 1 (smallest mean 0.05). Cosines to [0.1, 0]: 0.707, 1, 1, 0, 0.949.
    vectors = [[0.2, 0.2], [0.1, 0.0], [0.5, 0.0], [0.0, 0.4], [0.3, 0.1]]
    tie_order = [2, 0, 4, 3, 1]
    assert curriculum.paper_reference(np.array(vectors), np.ones(5, bool)) == 1
    # ids 2 and 1 are both parallel to the reference: a tie, kept in tie order.
    assert rank("paper", vectors, [True] * 5, tie_order) == [2, 1, 4, 0, 3]
    # Magnitude ignores direction: means 0.2, 0.05, 0.25, 0.2, 0.2.
    assert rank("magnitude", vectors, [True] * 5, tie_order) == [1, 0, 4, 3, 2]


def test_paper_zero_reference_orders_by_distance_to_zero():
    # Ids 1 and 3 are all-zero (smallest mean; the reference is id 1). Cosine is undefined,
    # so the key is the norm: 0, 0, 0.1, 0.495 (id 4), 0.5 (id 0). Id 5 is unseen.
    vectors = [[0.3, 0.4], [0.0, 0.0], [0.1, 0.0], [0.0, 0.0], [0.35, 0.35], [0.0, 0.0]]
    seen = [True, True, True, True, True, False]
    tie_order = [5, 3, 0, 2, 1, 4]
    assert curriculum.paper_reference(np.array(vectors), np.array(seen)) == 1
    assert rank("paper", vectors, seen, tie_order) == [3, 1, 2, 4, 0, 5]
    # Ids 0 and 4 have the same mean (0.35) but different norms.
    assert rank("magnitude", vectors, seen, tie_order) == [3, 1, 2, 0, 4, 5]


def test_unseen_examples_are_never_the_reference_and_come_last():
    # Id 0 is unseen (its stored zeros must not become a zero reference). Seen means 0.1,
    # 0.1, 0.2: the reference is id 1 ([0.2, 0]), cosines 1, 0.707, 1.
    vectors = [[0.0, 0.0], [0.2, 0.0], [0.1, 0.1], [0.4, 0.0]]
    seen = [False, True, True, True]
    assert rank("paper", vectors, seen, [3, 2, 1, 0]) == [3, 1, 2, 0]
    assert rank("paper", vectors, [False] * 4, [3, 2, 1, 0]) == [3, 2, 1, 0]
    assert rank("none", vectors, seen, [3, 2, 1, 0]) == [3, 2, 1, 0]


def test_bad_vectors_are_rejected_naming_the_example():
    with pytest.raises(ValueError, match=r"example 1 .* \[0, 1\]") as err:
        rank("paper", [[0.1, 0.2], [np.nan, 0.1]], [True, True], [0, 1])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"data\.curriculum='cosine'"):
        rank("cosine", [[0.1]], [True], [0])


@pytest.mark.parametrize("policy", curriculum.POLICIES)
def test_epoch_order_is_a_permutation_that_drops_the_default_tail(policy):
    rng = np.random.default_rng(1)
    num, batch = 23, 4  # 5 full batches; 3 examples dropped per epoch
    vectors = (rng.integers(0, 9, (num, 3)) / 8).astype(np.float32)  # many exact ties
    seen = rng.random(num) < 0.8
    for epoch in (1, 2):
        order = curriculum.epoch_order(policy, vectors, seen, epoch=epoch, seed=7, batch_size=batch)
        default = default_epoch_order(epoch, num_examples=num, seed=7, shuffle=True)
        assert sorted(order.tolist()) == list(range(num))
        assert order[20:].tolist() == default[20:].tolist()  # the same 3 left out
        if policy == "none":
            assert order.tolist() == default.tolist()
        else:  # seen examples first, by non-decreasing key
            kept_seen = order[:20][seen[order[:20]]]
            assert seen[order[: len(kept_seen)]].all()
            assert np.all(np.diff(reference_keys(policy, vectors, seen)[kept_seen]) >= -1e-6)


def reference_keys(policy, vectors, seen):
    """The documented keys, written out independently of the module."""
    vectors = vectors.astype(np.float64)
    means = vectors.mean(1)
    if policy == "magnitude":
        return means
    ref = vectors[min(np.flatnonzero(seen), key=lambda i: (means[i], i))]
    norms = np.sqrt((vectors**2).sum(1))
    if not ref.any():
        return norms
    return -(vectors @ ref) / (norms * np.sqrt((ref**2).sum()))


# --- the store -------------------------------------------------------------------------


def test_store_gives_each_checkpoint_exactly_what_it_saw(tmp_path):
    store = ComplexityStore(tmp_path, num_examples=5, writer=True)
    log_rows = 4  # 2 steps of 2 per epoch; 1 example dropped per epoch
    store.record(0, 0, log_rows, np.array([3, 1]), np.array([[0.5, 0.25], [0.0, 0.0]]))
    store.record(0, 1, log_rows, np.array([0, -1]), np.array([[1.0, 0.5], [0.7, 0.7]]))
    # A checkpoint after step 1 of epoch 0 saw only ids 3 and 1.
    vectors, seen = store.complexities_at(0, rows=2)
    assert seen.tolist() == [False, True, False, True, False]
    assert vectors[3].tolist() == [0.5, 0.25] and vectors[1].tolist() == [0.0, 0.0]
    store.freeze_next(0, rows=4)  # the -1 row (a non-finite step) is not applied
    vectors, seen = store.read_frozen(1)
    assert seen.tolist() == [True, True, False, True, False]
    assert vectors[0].tolist() == [1.0, 0.5] and vectors[2].tolist() == [0.0, 0.0]
    # Epoch 1 re-measures id 3; rows past a checkpoint (an abandoned run's) are ignored.
    store.record(1, 0, log_rows, np.array([3, 4]), np.array([[0.125, 0.0], [0.25, 0.25]]))
    store.record(1, 1, log_rows, np.array([2, 0]), np.array([[0.9, 0.9], [0.9, 0.9]]))
    vectors, seen = store.complexities_at(1, rows=2)
    assert seen.tolist() == [True, True, False, True, True]
    assert vectors[3].tolist() == [0.125, 0.0] and vectors[0].tolist() == [1.0, 0.5]
    assert not list(tmp_path.glob("*.tmp"))
    # Plain .npy files: readable without pickle by any numpy.
    assert np.load(store.path(1, "frozen"), allow_pickle=False)["seen"].sum() == 3


def test_store_garbage_collects_epochs_no_checkpoint_needs(tmp_path):
    store = ComplexityStore(tmp_path, num_examples=4, writer=True)
    for epoch in (0, 1, 2):
        store.record(epoch, 0, 4, np.arange(4), np.zeros((4, 1)))
        store.write_order(epoch, np.arange(4))
    for step, epoch in ((2, 0), (5, 1), (6, 2)):
        store.note_checkpoint(step, epoch)
    store.note_checkpoint(8, 2)  # still being written: not listed yet
    store.collect_garbage(listed_steps=[5, 6], current_epoch=2)
    assert sorted(p.name for p in tmp_path.glob("epoch_*")) == [
        "epoch_000001.log.npy",
        "epoch_000001.order.npy",
        "epoch_000002.log.npy",
        "epoch_000002.order.npy",
    ]
    assert json.loads((tmp_path / "checkpoints.json").read_text()) == {"5": 1, "6": 2, "8": 2}
    store.collect_garbage(listed_steps=[], current_epoch=2)  # nothing finished: keep all
    assert len(list(tmp_path.glob("epoch_*"))) == 4
    with pytest.raises(ValueError, match=r"epoch_000000\.order\.npy is missing"):
        store.read_order(0)


def test_order_from_stored_complexities_is_identical_in_a_fresh_process(tmp_path):
    rng = np.random.default_rng(0)
    store = ComplexityStore(tmp_path, num_examples=50, writer=True)
    store.write_frozen(
        3, (rng.integers(0, 5, (50, 4)) / 4).astype(np.float32), rng.random(50) < 0.9
    )
    vectors, seen = store.read_frozen(3)
    here = curriculum.epoch_order("paper", vectors, seen, epoch=3, seed=5, batch_size=8)
    code = (
        "import sys, numpy as np\n"
        "from jaxmoe.data import curriculum\n"
        "from jaxmoe.data.complexity_store import ComplexityStore\n"
        "v, s = ComplexityStore(sys.argv[1], 50, writer=False).read_frozen(3)\n"
        "o = curriculum.epoch_order('paper', v, s, epoch=3, seed=5, batch_size=8)\n"
        "print(','.join(map(str, o)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == ",".join(map(str, here))


# --- the loader under each policy ------------------------------------------------------


@pytest.fixture(scope="module")
def text_source(tmp_path_factory):
    """A 2-document text source: 75 train windows of 64 tokens, 4 steps of 16 per epoch."""
    import pydoc_data.topics

    directory = tmp_path_factory.mktemp("text")
    topics = pydoc_data.topics.topics
    (directory / "a.txt").write_text("\n\n".join(topics[k] for k in sorted(topics)[:2]))
    return directory


def small_config(text_source, *overrides):
    from tests.helpers import tiny_config

    return tiny_config(
        f"data.source=text:{text_source}/*.txt",
        f"data.cache_dir={text_source}/cache",
        "model.vocab_size=0",
        "train.seq_len=64",
        "train.batch_size=16",
        *overrides,
    )


@pytest.mark.parametrize("policy", curriculum.POLICIES)
def test_loader_yields_every_example_once_per_epoch_in_shard_windows(text_source, policy):
    config = small_config(text_source)
    tokenizer = build_data(config).tokenizer
    shards = [train_batches(config, tokenizer, p, 2) for p in range(2)]
    num, batch = shards[0].num_examples, 16
    vectors = (np.random.default_rng(2).integers(0, 5, (num, 2)) / 4).astype(np.float32)
    orders = {}

    def order_of(epoch):
        orders[epoch] = curriculum.epoch_order(
            policy, vectors, np.ones(num, bool), epoch=epoch, seed=0, batch_size=batch
        )
        return orders[epoch]

    for shard in shards:
        shard.set_epoch_order(order_of)
    steps = num // batch
    for epoch in range(2):
        ids = []
        for step in range(steps):
            rows = [next(shard)["example_ids"] for shard in shards]
            ids_B = np.concatenate(rows)  # process 0's rows, then process 1's
            # Every shard of a step holds a window of B consecutive ranks of the order.
            assert ids_B.tolist() == orders[epoch][step * batch : (step + 1) * batch].tolist()
            ids += ids_B.tolist()
        assert len(ids) == len(set(ids)) == steps * batch
        assert set(ids) == set(orders[epoch][: steps * batch].tolist())


# --- end to end through train() ----------------------------------------------------------

STEPS_PER_EPOCH, BATCH = 4, 16  # 75 examples: 64 trained per epoch, 11 dropped


def e2e_config(text_source, steps, *extra):
    return small_config(
        text_source,
        f"train.steps={steps}",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.max_to_keep=10",
        "optimizer.schedule=constant",
        "optimizer.warmup_steps=0",
        *extra,
    )


def read_metrics(workdir):
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if r["split"] == "train"}


def load(workdir, epoch, kind):
    return np.load(workdir / "curriculum" / f"epoch_{epoch:06d}.{kind}.npy")


@pytest.fixture(scope="module")
def paper_run(text_source, tmp_path_factory):
    """10 steps = 2.5 epochs; checkpoints 6 (mid epoch 1) and 10."""
    from jaxmoe.training.loop import train

    workdir = tmp_path_factory.mktemp("paper")
    config = e2e_config(text_source, 10, "data.curriculum=paper", "train.checkpoint_every=6")
    train(config, str(workdir), progress=False)
    return config, workdir


def test_paper_run_logs_routing_and_orders_each_epoch_by_it(paper_run):
    _, workdir = paper_run
    metrics = read_metrics(workdir)
    num = 75
    orders = {0: default_epoch_order(0, num_examples=num, seed=0, shuffle=True)}
    orders |= {epoch: load(workdir, epoch, "order") for epoch in (1, 2)}
    frozen = {epoch: load(workdir, epoch, "frozen") for epoch in (1, 2)}
    logs = {epoch: load(workdir, epoch, "log") for epoch in (1, 2)}  # epoch 0's may be GC'd

    def assert_matches_metrics(step, top2_BM):
        for layer in (0, 1):  # B rows of L tokens: their mean is the logged batch fraction
            expected = metrics[step][f"top2_fraction/layer_{layer}"]
            assert top2_BM[:, layer].mean() == pytest.approx(expected, abs=1e-6), (step, layer)

    # Epoch 0 ran in the default order; frozen_1 holds what each of its steps measured.
    assert frozen[1]["seen"].tolist() == np.isin(np.arange(num), orders[0][:64]).tolist()
    for position in range(STEPS_PER_EPOCH):
        ids = orders[0][position * BATCH : (position + 1) * BATCH]
        assert_matches_metrics(position + 1, frozen[1]["top2"][ids])
    for epoch, done in ((1, 64), (2, 32)):  # epoch 2 stopped after 2 of its 4 steps
        assert logs[epoch]["id"][:done].tolist() == orders[epoch][:done].tolist()
        assert (logs[epoch]["id"][done:] == -1).all()
        for position in range(done // BATCH):
            rows = logs[epoch][position * BATCH : (position + 1) * BATCH]
            assert_matches_metrics(epoch * STEPS_PER_EPOCH + position + 1, rows["top2"])
    # frozen_2 = frozen_1 updated with epoch 1's routing, by hand.
    latest, seen = np.array(frozen[1]["top2"]), np.array(frozen[1]["seen"])
    for row in logs[1]:
        latest[row["id"]], seen[row["id"]] = row["top2"], True
    np.testing.assert_array_equal(frozen[2]["top2"], latest)
    np.testing.assert_array_equal(frozen[2]["seen"], seen)
    for epoch in (1, 2):  # each stored order is the paper policy's order of its complexities
        # The reference is the fewest top-2 tokens (data.curriculum_reference=count): the
        # stored counts are the fractions times the real tokens.
        tokens = frozen[epoch]["tokens"][frozen[epoch]["seen"]]
        assert (tokens > 0).all()
        np.testing.assert_array_equal(
            frozen[epoch]["top2_count"], np.rint(frozen[epoch]["top2"] * frozen[epoch]["tokens"])
        )
        assert (
            orders[epoch].tolist()
            == curriculum.epoch_order(
                "paper",
                frozen[epoch]["top2"],
                frozen[epoch]["seen"],
                epoch=epoch,
                seed=0,
                batch_size=BATCH,
                counts_NM=frozen[epoch]["top2_count"],
            ).tolist()
        )


def test_paper_run_resumes_mid_epoch_exactly(paper_run, tmp_path):
    from jaxmoe.training.loop import train

    config, full = paper_run
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    # As if killed after checkpoint 6 (epoch 1, step 2 of 4); later files stay, as after a
    # crash, and the resumed run must overwrite them with the same values.
    shutil.rmtree(resumed / "checkpoints" / "10")
    summary = train(config, str(resumed), progress=False)
    assert summary["step"] == 10
    before, after = read_metrics(full), read_metrics(resumed)
    for step in range(7, 11):
        assert after[step]["loss"] == pytest.approx(before[step]["loss"], abs=1e-5), step
    for kind in ("frozen", "order", "log"):
        np.testing.assert_array_equal(load(resumed, 2, kind), load(full, 2, kind))


def test_changing_the_policy_of_a_run_is_refused(paper_run, text_source, tmp_path):
    from jaxmoe.training.loop import train

    _, full = paper_run
    shutil.copytree(full, tmp_path / "w")
    for policy in ("magnitude", "none"):
        other = e2e_config(text_source, 12, f"data.curriculum={policy}")
        with pytest.raises(ValueError, match=re.escape(f"data.curriculum={policy!r} but")):
            train(other, str(tmp_path / "w"), progress=False)


def test_curriculum_needs_an_moe_model(text_source, tmp_path):
    from jaxmoe.training.loop import train

    config = e2e_config(text_source, 2, "data.curriculum=magnitude", "model.moe.num_experts=0")
    with pytest.raises(ValueError, match=r"model\.moe\.num_experts=0") as err:
        train(config, str(tmp_path), progress=False)
    assert "\n" not in str(err.value)


def test_scoring_pass_measures_every_example_at_the_epoch_boundary(text_source, tmp_path):
    """The scoring source without train(): the hooks on a real loader, mesh and model."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    from jaxmoe.models import build_model
    from jaxmoe.models.spec import model_params
    from jaxmoe.parallel.mesh import make_mesh
    from jaxmoe.parallel.sharding import batch_spec
    from jaxmoe.training.curriculum_hooks import make_curriculum

    # Router jitter on: the pass must measure without it (train=False, training gate).
    config = small_config(
        text_source,
        "data.curriculum=magnitude",
        "model.vocab_size=512",
        "model.moe.jitter=0.5",
        "data.curriculum_source=scoring_pass",
    )
    mesh = make_mesh(config.mesh)  # 8 devices, data parallel
    data = build_data(config)
    shardings = {
        key: NamedSharding(mesh, batch_spec(mesh, np.ndim(value), BATCH))
        for key, value in data.eval_batches[0].items()
    }
    hooks = make_curriculum(config, str(tmp_path), data.train, shardings)
    _, params = model_params(build_model(config.model, rngs=nnx.Rngs(params=3, jitter=4)))
    # The reference model: the same parameters without jitter (so no RNG state either).
    no_jitter = small_config(text_source, "model.vocab_size=512").model
    graphdef, _ = model_params(build_model(no_jitter, rngs=nnx.Rngs(params=0)))
    for _ in range(STEPS_PER_EPOCH):
        with jax.set_mesh(mesh):
            hooks.before_batch(params)
        next(data.train)
    with jax.set_mesh(mesh):
        hooks.before_batch(params)  # the boundary: scores all 75 examples
        hooks.observe({}, {})  # the scoring source keeps no per-step log
    frozen = load(tmp_path, 1, "frozen")
    assert frozen["seen"].all()
    assert not list((tmp_path / "curriculum").glob("*.log.npy"))

    @jax.jit
    def routing(params, inputs):  # unsharded; no jitter, so train=True = training gate
        _, aux = nnx.merge(graphdef, params)(inputs, train=True)
        return jnp.stack([aux[i]["top2_per_example"] for i in sorted(aux)], 1)

    reference = np.asarray(routing(params, data.train.examples.batch(np.arange(75))["inputs"]))
    assert 0.05 < reference.mean() < 0.95  # the gate is mixed: a meaningful comparison
    # Sharded and unsharded float sums may flip a gate decision right at the threshold.
    diff = np.abs(frozen["top2"] - reference)
    assert np.mean(diff > 1e-6) < 0.05 and diff.max() <= 2 / 64 + 1e-6
    order = load(tmp_path, 1, "order")
    trained = np.concatenate([next(data.train)["example_ids"] for _ in range(STEPS_PER_EPOCH)])
    assert trained.tolist() == order[:64].tolist()  # epoch 1 follows the stored order
    if not diff.max():
        assert (
            order.tolist()
            == curriculum.epoch_order(
                "magnitude", reference, np.ones(75, bool), epoch=1, seed=0, batch_size=BATCH
            ).tolist()
        )


@pytest.mark.slow
def test_two_processes_order_and_train_like_one(paper_run, text_source, tmp_path):
    """launch/local.sh: 2 processes x 4 devices, routing allgathered, orders written by
    process 0 and read by both after a barrier; equal to the 1-process paper run."""
    import os

    _, single = paper_run
    flags = {
        "model.vocab_size": 0,
        "model.num_layers": 2,
        "model.d_model": 32,
        "model.num_heads": 4,
        "model.num_kv_heads": 2,
        "model.head_dim": 8,
        "model.ffn_dim": 64,
        "model.moe.ffn_dim": 32,
        "model.moe.block_size": 8,
        "train.batch_size": BATCH,
        "train.seq_len": 64,
        "train.steps": 10,
        "optimizer.warmup_steps": 0,
        "optimizer.schedule": "constant",
        "data.vocab_size": 512,
        "data.source": f"text:{text_source}/*.txt",
        "data.cache_dir": f"{text_source}/cache",
        "data.curriculum": "paper",
        "train.log_every": 1,
        "train.eval_every": 0,
        "train.eval_batches": 1,
        "train.max_to_keep": 10,
        "train.checkpoint_every": 6,
    }
    workdir = tmp_path / "multi"
    args = ["train", "--config", "configs/default.py", "--workdir", str(workdir), "--no_progress"]
    args += [f"--config.{key}={value}" for key, value in flags.items()]
    result = subprocess.run(
        ["bash", "launch/local.sh", "2", "--devices_per_process", "4", "--", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    one, two = read_metrics(single), read_metrics(workdir)
    for step in range(1, 11):
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], abs=1e-5), step
    for epoch in (1, 2):
        np.testing.assert_array_equal(load(workdir, epoch, "order"), load(single, epoch, "order"))
