"""Span corruption for encoder-decoder training: hand-worked examples, an independent
reconstruction of every raw window from (encoder input, targets), resumable batches, and
an end-to-end `train()` of a tiny T5 whose loss falls."""

import json

import numpy as np
import pytest

from jaxmoe.data.seq2seq import (
    EXTRA_IDS,
    SpanCorruptionExamples,
    corrupted_lengths,
    noise_mask,
    raw_length_for,
    replace_spans,
)
from tests.fixtures_data import build_data, copy_data_cache, train_batches
from tests.helpers import tiny_config

EOS = 1


def seq2seq_config(cache_dir, *overrides):
    return tiny_config(
        "model.arch=encoder_decoder",
        "model.activation=gelu",
        "model.rope_theta=0.0",
        "model.moe.num_experts=0",
        "model.vocab_size=0",
        "train.seq_len=32",
        f"data.cache_dir={cache_dir}",
        *overrides,
    )


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, embedded_data_cache):
    return copy_data_cache(embedded_data_cache, tmp_path_factory.mktemp("seq2seq") / "cache")


@pytest.fixture(scope="module")
def bundle(cache_dir):
    return build_data(seq2seq_config(cache_dir))


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


# --- The corruption itself, by hand ---------------------------------------------------


def test_hand_worked_span_corruption():
    # raw a..h = 10..17; masked spans (c d) and (h); sentinels count down from 99.
    tokens = np.arange(10, 18)
    mask = np.array([0, 0, 1, 1, 0, 0, 0, 1], bool)
    np.testing.assert_array_equal(replace_spans(tokens, mask, 99), [10, 11, 99, 14, 15, 16, 98])
    np.testing.assert_array_equal(replace_spans(tokens, ~mask, 99), [99, 12, 13, 98, 17])
    # A window that ends unmasked gives the targets a closing sentinel (T5 does the same).
    mask = np.array([0, 1, 0, 0, 0, 0, 0, 0], bool)
    np.testing.assert_array_equal(replace_spans(tokens, ~mask, 99), [99, 11, 98])


def test_lengths_by_hand():
    # N = 34: round(5.1) = 5 masked tokens in round(5 / 3) = 2 spans;
    # encoder 34 - 5 + 2 + EOS = 32, decoder 5 + 2 + EOS = 8. N = 35 gives encoder 33.
    assert corrupted_lengths(34, 0.15, 3.0) == (32, 8)
    assert corrupted_lengths(35, 0.15, 3.0) == (33, 8)
    assert raw_length_for(32, 0.15, 3.0) == 34
    # T5's standard pretraining shapes: 568 raw tokens -> inputs 512, targets 114.
    assert raw_length_for(512, 0.15, 3.0) == 568
    assert corrupted_lengths(568, 0.15, 3.0) == (512, 114)


def test_noise_mask_shape_of_spans():
    for seed in range(20):
        mask = noise_mask(34, 0.15, 3.0, np.random.default_rng(seed))
        starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
        assert mask.sum() == 5 and len(starts) == 2
        assert not mask[0] and mask[-1]  # T5's spans alternate, unmasked first, masked last
    masks = np.stack([noise_mask(34, 0.15, 3.0, np.random.default_rng(s)) for s in range(300)])
    assert masks[:, 1:-1].any(axis=0).all()  # every inner position gets masked sometimes


# --- Examples and batches ---------------------------------------------------------------


def reconstruct(encoder, targets, first_sentinel):
    """The raw window, rebuilt by a plain loop from unpadded, EOS-terminated ids: each
    sentinel in the encoder input is replaced by what follows it in the targets."""
    is_sentinel = lambda token: token > first_sentinel - EXTRA_IDS
    assert encoder[-1] == EOS and targets[-1] == EOS
    fills, current = {}, None
    for token in targets[:-1]:
        if is_sentinel(token):
            current = int(token)
            fills[current] = []
        else:
            fills[current].append(int(token))
    raw = []
    for token in encoder[:-1]:
        raw.extend(fills[int(token)] if is_sentinel(token) else [int(token)])
    return raw


def unpadded(batch, row):
    """(encoder ids, target ids) of one row without padding (the stream holds no id 0)."""
    encoder = batch["encoder_inputs"][row]
    return encoder[encoder != 0], batch["targets"][row][batch["weights"][row] > 0]


def test_examples_reconstruct_the_stream_and_batch_as_documented():
    stream = np.arange(3, 3 + 200) % 97 + 2  # ids 2..98, no EOS or pad inside
    examples = SpanCorruptionExamples(
        stream, encoder_len=16, seed=5, tokenizer_vocab=100, eos_id=EOS, partial_last=True
    )
    n = examples.raw_len
    assert (n, examples.decoder_len, len(examples)) == (17, 5, 12)  # 200 = 11 * 17 + 13
    assert examples.first_sentinel == 199
    batch = examples.batch(np.array([3, 11, -1, 0]))
    assert batch["encoder_inputs"].shape == (4, 16) and batch["targets"].shape == (4, 5)
    for row, index in enumerate([3, 11]):
        assert (
            reconstruct(*unpadded(batch, row), 199) == stream[index * n : (index + 1) * n].tolist()
        )
    assert np.all(batch["targets"][1, 4:] == 0)  # the partial last window: 13 raw tokens
    np.testing.assert_array_equal(batch["inputs"][:, 0], 0)
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert not batch["encoder_inputs"][2].any() and not batch["weights"][2].any()
    np.testing.assert_array_equal(batch["example_ids"], [3, 11, -1, 0])
    # Deterministic per (seed, index), whatever else is in the batch; seeds differ.
    alone = examples.batch(np.array([0]))
    np.testing.assert_array_equal(alone["encoder_inputs"][0], batch["encoder_inputs"][3])
    # (17-token windows hold one span, always last: compare seeds on longer windows.)
    longer = [
        SpanCorruptionExamples(stream, encoder_len=64, seed=seed, tokenizer_vocab=100, eos_id=1)
        for seed in (5, 6)
    ]
    assert longer[0].raw_len == 70
    differ = [not np.array_equal(longer[0].example(i)[0], longer[1].example(i)[0]) for i in (0, 1)]
    assert all(differ)


def test_too_many_spans_and_bad_densities_are_refused():
    stream = np.ones(10, int)
    with pytest.raises(ValueError, match="only 100 sentinel ids"):
        SpanCorruptionExamples(stream, encoder_len=4000, seed=0, tokenizer_vocab=9, eos_id=1)
    with pytest.raises(ValueError, match=r"data\.noise_density=1\.5 must be in"):
        SpanCorruptionExamples(
            stream, encoder_len=8, seed=0, tokenizer_vocab=9, eos_id=1, noise_density=1.5
        )


# --- Through build_data -----------------------------------------------------------------


def test_build_data_picks_span_corruption(bundle, cache_dir):
    tokenizer = bundle.tokenizer
    assert bundle.vocab_size == tokenizer.vocab_size + EXTRA_IDS
    batch = next(train_batches(seq2seq_config(cache_dir), tokenizer))
    assert set(batch) == {"encoder_inputs", "inputs", "targets", "weights", "example_ids"}
    assert batch["encoder_inputs"].shape == (8, 32) and batch["targets"].shape == (8, 8)
    assert np.all(batch["weights"] == 1)
    assert batch["targets"].max() < bundle.vocab_size
    assert batch["targets"][:, 0].min() == tokenizer.vocab_size + EXTRA_IDS - 1  # first S0
    stream = bundle.train.examples.tokens_N
    first = tokenizer.vocab_size + EXTRA_IDS - 1
    for row, index in enumerate(batch["example_ids"]):
        window = stream[index * 34 : (index + 1) * 34].tolist()
        assert reconstruct(*unpadded(batch, row), first) == window
    evals = bundle.eval_batches
    ids = np.concatenate([b["example_ids"] for b in evals])
    np.testing.assert_array_equal(ids[ids >= 0], np.arange(bundle.num_eval_examples))
    assert bundle.num_eval_examples == -(-bundle.num_eval_tokens // 34)


def test_resume_and_process_split_match_train_batches(bundle, cache_dir):
    config = seq2seq_config(cache_dir)
    batches = train_batches(config, bundle.tokenizer)
    take(batches, batches.steps_per_epoch - 2)
    state = json.loads(json.dumps(batches.get_state()))
    expected = take(batches, 4)  # crosses into the next epoch
    resumed = train_batches(config, bundle.tokenizer)
    resumed.set_state(state)
    parts = [train_batches(config, bundle.tokenizer, p, 2) for p in range(2)]
    for part in parts:
        part.set_state(state)
    for step, batch in enumerate(expected):
        got = next(resumed)
        halves = [next(part) for part in parts]
        for key in batch:
            np.testing.assert_array_equal(got[key], batch[key], err_msg=key)
            joined = np.concatenate([h[key] for h in halves])
            np.testing.assert_array_equal(joined, batch[key], err_msg=f"{key} step {step}")


# --- End to end -------------------------------------------------------------------------


def test_tiny_t5_trains_and_evaluates(cache_dir, bundle, tmp_path):
    from jaxmoe.inference.evaluate import evaluate
    from jaxmoe.training.loop import train

    config = seq2seq_config(
        cache_dir,
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "train.steps=12",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=2",
        "optimizer.schedule=constant",
        "optimizer.warmup_steps=0",
        "optimizer.learning_rate=1e-2",
    )
    summary = train(config, str(tmp_path), progress=False)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in lines if r["split"] == "train"}
    assert losses[12] < losses[1] - 1.0, losses
    assert summary["eval"]["loss"] < losses[1]
    # Span-corrupted validation windows, scored by `jaxmoe eval`'s library function. (It only
    # loads a tokenizer for an encoder-decoder when data.tokenizer names one.)
    tokenizer = f"data.tokenizer={bundle.tokenizer.path}"
    result = evaluate(str(tmp_path), "embedded", overrides=[tokenizer, "train.batch_size=128"])
    assert result["num_tokens"] > 0 and result["loss"] < losses[1]


def test_batch_corrupts_rows_together_exactly_as_one_by_one():
    stream = np.random.default_rng(0).integers(2, 300, size=5000)
    for density, span in ((0.15, 3.0), (0.5, 1.0), (0.3, 8.0)):
        examples = SpanCorruptionExamples(
            stream,
            encoder_len=64,
            seed=3,
            tokenizer_vocab=300,
            eos_id=EOS,
            noise_density=density,
            mean_noise_span=span,
            partial_last=True,
        )
        ids = np.array([0, len(examples) - 1, -1, 7, 7, len(examples) - 2, 40])
        batch = examples.batch(ids)
        for row, index in enumerate(ids):
            enc = np.zeros(examples.encoder_len, int)
            tgt = np.zeros(examples.decoder_len, int)
            if index >= 0:  # the reference: one example at a time
                e, t = examples.example(int(index))
                enc[: len(e)], tgt[: len(t)] = e, t
            np.testing.assert_array_equal(batch["encoder_inputs"][row], enc)
            np.testing.assert_array_equal(batch["targets"][row], tgt)
            np.testing.assert_array_equal(batch["weights"][row], tgt != 0)
