"""Data pipeline: corpus split, tokenizer, TFDS round trip, packing, batches, resume, errors.

References are independent of the code under test: pydoc topics read directly, token
streams rebuilt by a per-document Python loop, hand-computed windows.
"""

import glob
import json
import os
import pydoc_data.topics
import subprocess
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds

from jaxmoe.config.defaults import base_config
from jaxmoe.config.schema import JobConfig
from jaxmoe.config.validation import validate
from jaxmoe.data import corpus, packing, pipeline, sources, tfds_text
from jaxmoe.data import tokenizer as tokenizer_lib
from tests.fixtures_data import build_data, eval_batches, train_batches

TOPICS = pydoc_data.topics.topics


def make_config(cache_dir, **overrides) -> JobConfig:
    """The complete default config (as every command gets one), with this file's data;
    `section__key=value` overrides."""
    config = base_config()
    config.data.cache_dir = str(cache_dir)
    config.train.update(seq_len=64, batch_size=8, seed=0)
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        config[section][key] = value
    return validate(config)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("jaxmoe_cache")


@pytest.fixture(scope="module")
def bundle(cache_dir):
    return build_data(make_config(cache_dir))


def topic_split():
    """(train docs, validation docs) from pydoc topics, by the documented hash rule."""
    train, val = [], []
    for key in sorted(TOPICS):
        (val if corpus.in_validation(key, 0.05) else train).append(TOPICS[key])
    return train, val


def reference_stream(tokenizer, docs) -> np.ndarray:
    """Naive per-document loop: each non-empty document's ids, then EOS."""
    out = []
    for doc in docs:
        ids = tokenizer.encode(doc)
        if ids:
            out.extend(ids)
            out.append(tokenizer.eos_id)
    return np.array(out, dtype=np.int64)


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


# --- corpus and tokenizer -------------------------------------------------------------


def test_embedded_split_is_a_deterministic_partition():
    train, val = topic_split()
    assert list(corpus.embedded_documents("train", 0.05)) == [d for d in train if d]
    assert list(corpus.embedded_documents("validation", 0.05)) == [d for d in val if d]
    assert 1 <= len(val) <= 0.15 * len(TOPICS)
    assert len(train) + len(val) == len(TOPICS)


def test_split_paragraphs_hand_made():
    text = "one\nline two\n\n\n  indented\r\n \t\nlast\n"
    assert corpus.split_paragraphs(text) == ["one\nline two", "  indented", "last"]
    assert corpus.split_paragraphs("\n \n") == []


def test_sentencepiece_round_trip_is_exact(bundle):
    tok = bundle.tokenizer
    assert (tok.vocab_size, tok.pad_id, tok.eos_id) == (1024, 0, 1)
    for text in TOPICS.values():
        ids = tok.encode(text)
        assert max(ids) < tok.vocab_size and tok.eos_id not in ids
        assert tok.decode(ids) == text
    for text in ["  two  spaces\t\ttabs\r\n", " leading", "Ünïcödé 😀 中文\n\n", ""]:
        assert tok.decode(tok.encode(text)) == text


def test_tokenizer_is_cached_and_deterministic(cache_dir, bundle, tmp_path, monkeypatch):
    first = bundle.tokenizer
    # A second load must come from the cache: training again would fail here.
    monkeypatch.setattr(tokenizer_lib, "train_sentencepiece", lambda *a, **k: 1 / 0)
    again = pipeline.load_tokenizer(make_config(cache_dir).data)
    assert again.path == first.path and again.sha256 == first.sha256
    monkeypatch.undo()
    fresh = pipeline.load_tokenizer(make_config(tmp_path).data)  # trains from scratch
    assert fresh.path != first.path and fresh.sha256 == first.sha256
    # A given .model file is used as is.
    given = pipeline.load_tokenizer(make_config(tmp_path, data__tokenizer=first.path).data)
    assert given.encode("hello world") == first.encode("hello world")


# --- TFDS ---------------------------------------------------------------------------


def test_tfds_builder_writes_array_record_and_reads_back_in_order(tmp_path):
    docs = {
        "train": [f"train doc {i}\nline two of {i}" for i in range(23)],
        "validation": [f"val {i} ✓" for i in range(12)],
    }
    tfds_text.prepare_local_dataset(lambda split: iter(docs[split]), str(tmp_path))
    files = glob.glob(str(tmp_path / tfds_text.LOCAL_DATASET_NAME / "*" / "*array_record*"))
    assert len(files) == 2
    for split, expected in docs.items():
        source = tfds.data_source(
            tfds_text.LOCAL_DATASET_NAME, split=split, data_dir=str(tmp_path), download=False
        )
        assert [source[i]["text"].decode() for i in range(len(source))] == expected
        assert list(tfds_text.TextSource(tfds_text.LOCAL_DATASET_NAME, split, str(tmp_path))) == (
            expected
        )
    # Idempotent: a second call with other documents leaves the prepared data alone.
    tfds_text.prepare_local_dataset(lambda split: iter(["x"]), str(tmp_path))
    source = tfds_text.TextSource(tfds_text.LOCAL_DATASET_NAME, "train", str(tmp_path))
    assert len(source) == 23


class JaxmoeTestStories(tfds.core.GeneratorBasedBuilder):
    """A stand-in for an already-prepared TFDS dataset: other split and feature names."""

    VERSION = tfds.core.Version("0.1.0")

    def _info(self):
        features = tfds.features.FeaturesDict({"body": tfds.features.Text(), "n": np.int32})
        return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(0, 60), "test": self._generate_examples(60, 70)}

    def _generate_examples(self, start, stop):
        for i in range(start, stop):
            yield i, {"body": TOPICS[sorted(TOPICS)[i]], "n": i}


def test_tfds_source_by_name(bundle, tmp_path):
    data_dir = str(tmp_path / "tfds")
    builder = JaxmoeTestStories(data_dir=data_dir)
    builder.download_and_prepare(
        file_format="array_record",
        download_config=tfds.download.DownloadConfig(try_download_gcs=False),
    )
    config = make_config(
        tmp_path,
        data__source="tfds:jaxmoe_test_stories",
        data__eval_split="test",
        data__text_key="body",
        data__data_dir=data_dir,
        data__tokenizer=bundle.tokenizer.path,
    )
    data = build_data(config)
    # tfds may store examples in any order: compare the multiset of documents.
    test_docs = [TOPICS[k] for k in sorted(TOPICS)[60:70]]
    expected = reference_stream(data.tokenizer, test_docs)
    assert data.num_eval_tokens == expected.size
    windows = sources.packed_split(
        config.data, config.train.seq_len, data.tokenizer, "eval_split", True
    )
    got = np.asarray(windows.tokens_N)
    eos = data.tokenizer.eos_id
    split_docs = lambda s: sorted(map(tuple, np.split(s, np.flatnonzero(s == eos) + 1)))
    assert split_docs(got) == split_docs(expected)
    for key, value in [("data__eval_split", "nope"), ("data__text_key", "text")]:
        with pytest.raises(ValueError, match=key.replace("__", ".")) as err:
            build_data(make_config(tmp_path, **{**_overrides(config), key: value}))
        assert "\n" not in str(err.value)


def _overrides(config):
    return {f"data__{k}": v for k, v in config.data.to_dict().items()}


# --- packing ------------------------------------------------------------------------


class CharTokenizer:
    """Test double: one id per character (its code point), EOS = 1."""

    vocab_size, eos_id, pad_id, bos_id = 1000, 1, 0, None

    def encode_batch(self, texts):
        return [[ord(c) for c in t] for t in texts]


def test_packing_hand_made(tmp_path):
    path = str(tmp_path / "tokens.npy")
    packing.write_token_cache(["ab", "", "cde"], CharTokenizer(), path)
    a, b, c, d, e = 97, 98, 99, 100, 101
    stream = packing.load_tokens(path)
    assert stream.dtype == np.uint16
    np.testing.assert_array_equal(stream, [a, b, 1, c, d, e, 1])

    train = packing.PackedWindows(stream, seq_len=2, pad_id=0, partial_last=False)
    assert len(train) == 3  # 6 targets / 2
    batch = train.batch(np.array([2, 0, 1]))
    np.testing.assert_array_equal(batch["inputs"], [[d, e], [a, b], [1, c]])
    np.testing.assert_array_equal(batch["targets"], [[e, 1], [b, 1], [c, d]])
    np.testing.assert_array_equal(batch["weights"], np.ones((3, 2)))

    # seq_len 4: one whole window for training; eval adds the partial one, padded.
    assert len(packing.PackedWindows(stream, 4, 0, partial_last=False)) == 1
    evals = packing.PackedWindows(stream, 4, 0, partial_last=True)
    assert len(evals) == 2
    batch = evals.batch(np.array([0, 1, -1]))
    np.testing.assert_array_equal(batch["inputs"], [[a, b, 1, c], [d, e, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["targets"], [[b, 1, c, d], [e, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["weights"], [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["example_ids"], [0, 1, -1])


# --- training batches ---------------------------------------------------------------


def test_train_epoch_covers_every_example_once_with_shifted_targets(cache_dir, bundle):
    train_docs, _ = topic_split()
    stream = reference_stream(bundle.tokenizer, train_docs)
    assert bundle.num_train_tokens == stream.size
    L, B = 64, 8
    assert bundle.num_train_examples == (stream.size - 1) // L
    batches = train_batches(make_config(cache_dir), bundle.tokenizer)
    steps = batches.steps_per_epoch
    assert steps == bundle.num_train_examples // B
    seen = []
    for batch in take(batches, steps):
        assert batch["inputs"].shape == (B, L) and batch["inputs"].dtype == np.int32
        assert batch["weights"].dtype == np.float32 and np.all(batch["weights"] == 1)
        for row, example in enumerate(batch["example_ids"]):
            window = stream[example * L : example * L + L + 1]
            np.testing.assert_array_equal(batch["inputs"][row], window[:-1])
            np.testing.assert_array_equal(batch["targets"][row], window[1:])
        seen.extend(batch["example_ids"].tolist())
    assert len(seen) == len(set(seen)) == steps * B
    assert batches.get_state()["epoch"] == 0
    next(batches)
    assert batches.get_state()["epoch"] == 1


def test_batches_are_deterministic_by_seed(cache_dir, bundle):
    tok = bundle.tokenizer
    first = take(train_batches(make_config(cache_dir), tok), 3)
    assert_batches_equal(first, take(train_batches(make_config(cache_dir), tok), 3))
    other = take(train_batches(make_config(cache_dir, train__seed=1), tok), 3)
    assert not np.array_equal(first[0]["example_ids"], other[0]["example_ids"])
    ordered = next(train_batches(make_config(cache_dir, data__shuffle=False), tok))
    np.testing.assert_array_equal(ordered["example_ids"], np.arange(8))


def test_resume_from_state_is_exact_across_epochs(cache_dir, bundle):
    # seq_len 512 x batch 32: about 9 steps per epoch, so 7 + 5 steps cross an epoch.
    config = make_config(cache_dir, train__seq_len=512, train__batch_size=32)
    batches = train_batches(config, bundle.tokenizer)
    assert 7 < batches.steps_per_epoch < 12
    take(batches, 7)
    state = json.loads(json.dumps(batches.get_state()))
    expected = take(batches, 5)
    resumed = train_batches(config, bundle.tokenizer)
    resumed.set_state(state)
    assert_batches_equal(take(resumed, 5), expected)
    with pytest.raises(ValueError, match="global_batch_size"):
        resumed.set_state({**state, "global_batch_size": 16})


def test_two_processes_concatenate_to_one(cache_dir, bundle):
    config = make_config(cache_dir, train__seq_len=512, train__batch_size=32)
    tok = bundle.tokenizer
    whole = take(train_batches(config, tok), 12)
    parts = [take(train_batches(config, tok, p, 2), 12) for p in range(2)]
    for step, batch in enumerate(whole):
        for key in batch:
            joined = np.concatenate([parts[0][step][key], parts[1][step][key]])
            np.testing.assert_array_equal(joined, batch[key], err_msg=key)
    evals = eval_batches(config, tok)
    eval_parts = [eval_batches(config, tok, None, p, 2) for p in range(2)]
    for step, batch in enumerate(evals):
        joined = np.concatenate([eval_parts[0][step]["targets"], eval_parts[1][step]["targets"]])
        np.testing.assert_array_equal(joined, batch["targets"])


def test_eval_covers_every_validation_token_once(cache_dir, bundle):
    _, val_docs = topic_split()
    stream = reference_stream(bundle.tokenizer, val_docs)
    assert bundle.num_eval_tokens == stream.size
    targets = np.concatenate(
        [b["targets"][b["weights"] == 1] for b in bundle.eval_batches]  # row-major order
    )
    np.testing.assert_array_equal(targets, stream[1:])
    assert all(b["inputs"].shape == (8, 64) for b in bundle.eval_batches)
    last = bundle.eval_batches[-1]
    assert np.all(last["weights"][last["example_ids"] < 0] == 0)
    short = eval_batches(make_config(cache_dir), bundle.tokenizer, max_batches=1)
    assert_batches_equal(short, bundle.eval_batches[:1])


def test_text_files_source(bundle, tmp_path):
    texts = [TOPICS[k] for k in sorted(TOPICS)[:12]]
    for i, text in enumerate(texts):
        (tmp_path / f"f{i:02d}.txt").write_text(text, encoding="utf-8")
    paragraphs = [p for t in texts for p in corpus.split_paragraphs(t)]
    config = make_config(
        tmp_path / "cache",
        data__source=f"text:{tmp_path}/*.txt",
        data__tokenizer=bundle.tokenizer.path,
    )
    data = build_data(config)
    val = [p for p in paragraphs if corpus.in_validation(p, 0.05)]
    train = [p for p in paragraphs if not corpus.in_validation(p, 0.05)]
    assert val and train
    assert data.num_train_tokens == reference_stream(data.tokenizer, train).size
    assert data.num_eval_tokens == reference_stream(data.tokenizer, val).size


# --- errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        ({"data__source": "hdfs:x"}, "data.source"),
        ({"data__source": "text:/nonexistent/dir/*.txt"}, "data.source"),
        ({"data__tokenizer": "/nonexistent/x.model"}, "data.tokenizer"),
        ({"train__seq_len": 10**6}, "train.seq_len"),
        ({"data__eval_split": "test"}, "data.eval_split"),
        ({"data__vocab_size": 100}, "data.vocab_size"),
        ({"train__batch_size": 10**5}, "train.batch_size"),
        ({"data__source": "tfds:no_such_dataset_xyz"}, "data.source"),
    ],
)
def test_bad_inputs_give_one_line_errors(cache_dir, bundle, overrides, names):
    del bundle  # built first, so these cases fail fast on their own key
    with pytest.raises(ValueError, match=names.replace(".", r"\.")) as err:
        build_data(make_config(cache_dir, **overrides))
    assert "\n" not in str(err.value)


def test_batch_size_must_split_across_processes(cache_dir, bundle):
    with pytest.raises(ValueError, match=r"train\.batch_size=8 .* process count 3"):
        train_batches(make_config(cache_dir), bundle.tokenizer, 0, 3)


def test_single_paragraph_text_source_has_no_validation_text(bundle, tmp_path):
    (tmp_path / "a.txt").write_text("only one paragraph here " * 50)
    config = make_config(
        tmp_path / "cache",
        data__source=f"text:{tmp_path}/a.txt",
        data__tokenizer=bundle.tokenizer.path,
        train__seq_len=8,
        train__batch_size=2,
    )
    with pytest.raises(ValueError, match=r"data\.source=.* has no documents") as err:
        build_data(config)
    assert "\n" not in str(err.value)


def test_data_package_does_not_import_jax():
    code = "import sys, jaxmoe.data.pipeline; print('jax' in sys.modules)"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
