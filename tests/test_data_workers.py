"""data.workers: batches built in grain worker processes equal the in-process ones bit for
bit (LM packing and T5 span corruption, checked against a numpy reference too), and a run
resumed at step k with workers sees the batches of the uninterrupted run.

A tiny jsonl corpus is written to disk and prepared once (tokenizer, token caches); each
test then starts worker processes (spawned: a few seconds each under load)."""

import json

import numpy as np
import pytest

from jaxmoe.config.defaults import base_config
from jaxmoe.config.validation import validate
from jaxmoe.data.workers import WorkerBatches
from jaxmoe.errors import ConfigError
from tests.fixtures_data import build_data, train_batches

SEED = 3
# Greek letter names: enough distinct characters for a 300-piece byte-fallback vocabulary.
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi".split()  # noqa: SIM905


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(jsonl glob, data.cache_dir) of ~70 short documents, prepared once for the module."""
    root = tmp_path_factory.mktemp("workers_corpus")
    rng = np.random.default_rng(0)
    with open(root / "docs.jsonl", "w") as f:
        for i in range(70):
            words = rng.choice(WORDS, size=int(rng.integers(8, 30)))
            f.write(json.dumps({"text": f"doc {i}: " + " ".join(words) + "."}) + "\n")
    source, cache = f"jsonl:{root}/*.jsonl", str(root / "cache")
    build_data(config_for(source, cache, "decoder", 0))  # tokenizer + LM caches
    return source, cache


def config_for(source: str, cache: str, arch: str, workers: int):
    config = base_config()
    config.data.update(source=source, cache_dir=cache, vocab_size=300, prefetch=0)
    config.data.workers = workers
    config.model.arch = arch
    config.train.update(seq_len=24, batch_size=4, seed=SEED)
    return validate(config)


def take(batches, n: int) -> list[dict]:
    return [next(batches) for _ in range(n)]


def assert_same(got: list[dict], expected: list[dict]) -> None:
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert sorted(a) == sorted(b), step
        for key in a:
            assert type(a[key]) is np.ndarray, (step, key)  # not grain's shared memory
            assert a[key].dtype == b[key].dtype, (step, key)
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"step {step} {key}")


def numpy_lm_reference(tokens_N: np.ndarray, seq_len: int, batch_size: int, n: int):
    """LM batches by hand: shuffle by default_rng([seed, epoch]), window i = the tokens
    [i*L, i*L + L] of the stream, inputs its first L and targets its last L."""
    num_examples = (len(tokens_N) - 1) // seq_len
    steps = num_examples // batch_size
    out = []
    for step in range(n):
        epoch, position = divmod(step, steps)
        order = np.random.default_rng([SEED, epoch]).permutation(num_examples)
        ids = order[position * batch_size : (position + 1) * batch_size]
        windows = np.stack([tokens_N[i * seq_len : i * seq_len + seq_len + 1] for i in ids])
        windows = windows.astype(np.int32)
        out.append(
            {
                "inputs": windows[:, :-1],
                "targets": windows[:, 1:],
                "weights": np.ones((batch_size, seq_len), np.float32),
                "example_ids": ids.astype(np.int32),
            }
        )
    return out


def t5_reference(examples, batches: list[dict]) -> None:
    """Each row equals its example's own span corruption (`example`, one window at a time,
    not the batch's row-wise path), zero-padded."""
    for batch in batches:
        for row, index in enumerate(batch["example_ids"]):
            encoder, targets = examples.example(int(index))
            assert batch["encoder_inputs"][row, : len(encoder)].tolist() == encoder.tolist()
            assert not batch["encoder_inputs"][row, len(encoder) :].any()
            assert batch["targets"][row, : len(targets)].tolist() == targets.tolist()
            assert batch["weights"][row].sum() == len(targets)


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_workers_equal_in_process_and_resume_exactly(corpus, arch):
    source, cache = corpus
    plain = build_data(config_for(source, cache, arch, 0)).train
    steps = plain.steps_per_epoch
    n = 2 * steps + 3  # crosses two epoch boundaries
    expected = take(plain, n)
    if arch == "decoder":
        tokens_N = np.load(plain.examples.tokens_N.filename)  # read anew, not the memmap
        assert_same(expected, numpy_lm_reference(tokens_N, 24, 4, n))
    else:
        t5_reference(plain.examples, expected)

    # Uninterrupted, with 2 workers: the same batches and, mid-run, the state after the last
    # batch handed out (not after those the workers built ahead).
    on = build_data(config_for(source, cache, arch, 2)).train
    assert isinstance(on, WorkerBatches)
    got = take(on, steps)
    state = json.loads(json.dumps(on.get_state()))  # as a checkpoint stores it
    assert state == {"epoch": 0, "position": steps, **_sizes(plain)}  # end of epoch 0
    assert_same(got + take(on, n - steps), expected)
    assert on.get_state() == plain.get_state()
    on.close()

    # Resumed at step k = steps in a new pipeline with workers.
    resumed = build_data(config_for(source, cache, arch, 2)).train
    resumed.set_state(state)
    assert_same(take(resumed, n - steps), expected[steps:])
    resumed.close()
    # ... and the in-process pipeline resumes the workers' state alike.
    back = build_data(config_for(source, cache, arch, 0)).train
    back.set_state(state)
    assert_same(take(back, 3), expected[steps : steps + 3])


def _sizes(train) -> dict:
    return {"num_examples": train.num_examples, "global_batch_size": train.global_batch_size}


def test_a_worker_error_reaches_the_training_loop(corpus):
    """An epoch order that shortens epoch 1 fails in the worker building its first step; the
    batches before it come through, then the error is raised in the training process."""
    source, cache = corpus
    config = config_for(source, cache, "decoder", 1)
    bundle = build_data(config)
    n = bundle.train.num_examples

    def order(epoch):  # a closure: pickled by value into the worker
        return np.arange(n if epoch == 0 else n // 2)

    train = train_batches(config, bundle.tokenizer, epoch_order=order)
    steps = train.steps_per_epoch
    on = WorkerBatches(train, workers=1, depth=2)
    assert [b["example_ids"][0] for b in take(on, steps)] == list(range(0, 4 * steps, 4))
    with pytest.raises(ValueError, match=r"epoch_order\(1\) makes \d+ steps, not the"):
        next(on)
    on.close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"workers": -1}, "data.workers=-1 must be >= 0 (0 = in-process)"),
        (
            {"workers": 2, "curriculum": "paper"},
            "data.workers=2 builds cached single-source batches only, not with "
            "data.curriculum='paper' (set data.workers=0)",
        ),
        ({"workers": 1, "streaming": True}, "not with data.streaming=true"),
        ({"workers": 1, "mixture": "embedded=1"}, "not with data.mixture='embedded=1'"),
        ({"workers": 1, "shards": 2}, "not with data.shards=2"),
    ],
)
def test_bad_workers_values_fail_at_load_with_one_line(overrides, message):
    config = base_config()
    config.data.update(**overrides)
    with pytest.raises(ConfigError) as error:
        validate(config)  # a ConfigDict as a config file builds it
    assert message in str(error.value) and "\n" not in str(error.value)
