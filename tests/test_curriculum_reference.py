"""The paper's curriculum reference: the example with the FEWEST top-2 tokens
(`data.curriculum_reference = count`), against today's smallest mean fraction (`mean`).

They differ when examples have different numbers of real tokens (padding, variable
lengths). References: orders and counts computed by hand below; a store written without
counts (before they were kept) falls back to the mean with one warning.
"""

import logging

import jax.numpy as jnp
import numpy as np

from jaxmoe.data import curriculum
from jaxmoe.data.complexity_store import ComplexityStore, frozen_dtype
from jaxmoe.training.curriculum_hooks import Curriculum
from jaxmoe.training.steps import real_tokens_BM

# Four examples, two MoE layers: real tokens and top-2 tokens per layer.
TOKENS = np.array([[4, 4], [100, 100], [50, 50], [8, 8]], np.float32)
COUNTS = np.array([[3, 1], [10, 10], [5, 20], [2, 0]], np.float32)
FRACTIONS = COUNTS / TOKENS  # [.75 .25] [.1 .1] [.1 .4] [.25 0]
# By hand: top-2 tokens over layers 4, 20, 25, 2 -> fewest: example 3. Mean fractions
# .5, .1, .25, .125 -> smallest: example 1 (long, few top-2 tokens per token, 20 of them).
# Cosine to example 3 ([.25, 0], i.e. direction (1, 0)): 1 (3), .9487 (0), .7071 (1), .2425 (2).
BY_COUNT = [3, 0, 1, 2]
# Cosine to example 1 (direction (1, 1)): 1 (1), .8944 (0), .8575 (2), .7071 (3).
BY_MEAN = [1, 0, 2, 3]


def test_count_and_mean_choose_different_references_for_uneven_lengths():
    seen = np.ones(4, bool)
    assert curriculum.paper_reference(FRACTIONS, seen, COUNTS) == 3
    assert curriculum.paper_reference(FRACTIONS, seen) == 1
    kwargs = dict(epoch=1, seed=0, batch_size=4)
    order = curriculum.epoch_order("paper", FRACTIONS, seen, counts_NM=COUNTS, **kwargs)
    assert order.tolist() == BY_COUNT
    assert curriculum.epoch_order("paper", FRACTIONS, seen, **kwargs).tolist() == BY_MEAN


def test_unseen_examples_are_never_the_reference():
    seen = np.array([True, True, True, False])
    assert curriculum.paper_reference(FRACTIONS, seen, COUNTS) == 0  # 4 top-2 tokens


def test_padded_positions_are_not_real_tokens():
    weights = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], np.float32)
    batch = {"inputs": jnp.zeros((2, 5), jnp.int32), "weights": jnp.asarray(weights)}
    np.testing.assert_array_equal(real_tokens_BM(batch, [0, 1]), [[3, 3], [4, 4]])
    encoder = np.array([[5, 6, 0, 0, 0, 0], [5, 6, 7, 8, 9, 0]], np.int32)
    batch["encoder_inputs"] = jnp.asarray(encoder)
    layers = ["encoder_1", "decoder_1"]
    np.testing.assert_array_equal(real_tokens_BM(batch, layers), [[2, 3], [5, 4]])


def test_the_store_keeps_counts_through_the_log_and_the_frozen_file(tmp_path):
    store = ComplexityStore(tmp_path, 4, writer=True)
    for position, ids in enumerate([[2, 0], [3, 1]]):
        store.record(0, position, 4, np.array(ids), FRACTIONS[ids], COUNTS[ids], TOKENS[ids])
    store.freeze_next(0, 4)
    np.testing.assert_array_equal(store.read_frozen(1)[0], FRACTIONS)
    np.testing.assert_array_equal(store.read_frozen_counts(1), COUNTS)
    # Epoch 1 sees only examples 1 and 3 again; the others keep their epoch-0 counts.
    store.record(1, 0, 4, np.array([1, 3]), FRACTIONS[[1, 3]], COUNTS[[1, 3]], TOKENS[[1, 3]])
    store.freeze_next(1, 2)
    np.testing.assert_array_equal(store.read_frozen_counts(2), COUNTS)


def old_store(tmp_path):
    """A frozen file as written before the counts were kept: seen and top2 only."""
    store = ComplexityStore(tmp_path, 4, writer=True)
    records = np.zeros(4, frozen_dtype(2, counts=False))
    records["seen"], records["top2"] = True, FRACTIONS
    np.save(store.path(1, "frozen"), records)
    return store


def test_an_old_store_without_counts_orders_by_the_mean_with_one_warning(tmp_path, caplog):
    store = old_store(tmp_path)
    vectors, seen = store.read_frozen(1)
    np.testing.assert_array_equal(vectors, FRACTIONS)
    assert store.read_frozen_counts(1) is None
    hooks = object.__new__(Curriculum)  # only the reference logic, no train loop
    hooks.store, hooks.policy, hooks.reference = store, "paper", "count"
    hooks._warned_no_counts = False
    with caplog.at_level(logging.WARNING):
        assert hooks._reference_counts(1) is None
        assert hooks._reference_counts(1) is None
    assert sum("no top-2 token counts" in r.getMessage() for r in caplog.records) == 1
    counts = hooks._reference_counts(1)
    order = curriculum.epoch_order(
        "paper", vectors, seen, epoch=1, seed=0, batch_size=4, counts_NM=counts
    )
    assert order.tolist() == BY_MEAN


def test_rows_recorded_without_counts_make_the_counts_unknown(tmp_path):
    store = ComplexityStore(tmp_path, 4, writer=True)
    store.record(0, 0, 4, np.array([0, 1]), FRACTIONS[:2], COUNTS[:2], TOKENS[:2])
    store.record(0, 1, 4, np.array([2, 3]), FRACTIONS[2:])  # no counts given
    store.freeze_next(0, 4)
    assert store.read_frozen_counts(1) is None
