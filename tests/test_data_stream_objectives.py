"""Streaming for every objective (`data.streaming=True`): span corruption, mixtures and the
curriculum, on tiny jsonl files and a byte-level BPE tokenizer on disk.

References: per-lane Python loops over documents shuffled by np.random.default_rng, each
document tokenized on its own, and seq2seq's one-window noise_mask / replace_spans (tested by
hand in test_seq2seq.py); the mixture's row choice drawn again with np.random.default_rng.
"""

import json

import numpy as np
import pytest

from jaxmoe.data import pipeline
from jaxmoe.data.mixture import _CHOICE_TAG
from jaxmoe.data.seq2seq import _SEED_TAG, noise_mask, replace_spans
from jaxmoe.data.stream_objectives import _DOCUMENT_TAG
from tests.helpers import TINY_T5, tiny_config
from tests.test_data_sources import CONFIG, build_bpe, write_jsonl

BATCH, SEED = 8, 3


def texts(n: int, tag: str) -> list[str]:
    """Documents of ~3 to ~60 tokens: windows straddle documents, lanes wrap epochs often."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]
    return [
        f"{tag}{i} " + " ".join(words[: 1 + i * 7 % 9] * (1 + 3 * (i % 9 == 4))) for i in range(n)
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream_objectives")
    write_jsonl(root / "a" / "a.jsonl", texts(60, "a"))
    write_jsonl(root / "b" / "b.jsonl", texts(40, "b"))
    build_bpe(root / "tok", CONFIG)
    return root


def config(files, *overrides):
    return tiny_config(
        "model.vocab_size=0",
        f"train.batch_size={BATCH}",
        f"train.seed={SEED}",
        "train.seq_len=16",
        "data.streaming=True",
        "data.prefetch=0",
        f"data.tokenizer={files}/tok",
        f"data.source=jsonl:{files}/a/*.jsonl",
        f"data.cache_dir={files}/cache",
        *overrides,
    )


MIXTURE = "data.mixture=jsonl:{0}/a/*.jsonl=0.6,jsonl:{0}/b/*.jsonl=0.4"
KINDS = {  # name: extra overrides
    "span_corruption": TINY_T5,
    "mixture": (MIXTURE,),
    "span_corruption_mixture": (*TINY_T5, MIXTURE),
    "curriculum": ("data.curriculum=paper",),
    "span_corruption_curriculum": (*TINY_T5, "data.curriculum=paper"),
}


def kind_config(files, kind):
    return config(files, *(o.format(files) for o in KINDS[kind]))


def train_documents(cfg) -> list[str]:
    from jaxmoe.data.sources import open_split

    return list(open_split(cfg, "train_split").documents)


def lane_tokens(tokenizer, documents, lane, epochs):
    """(token, epoch, document index, offset) of every token lane `lane` reads, in order."""
    out = []
    for epoch in range(epochs):
        order = np.random.default_rng([SEED, epoch]).permutation(len(documents))
        for index in order[lane::BATCH]:
            ids = tokenizer.encode(documents[index])
            tokens = [tokenizer.bos_id, *ids, tokenizer.eos_id] if ids else []
            out += [(t, epoch, int(index), o) for o, t in enumerate(tokens)]
    return out


def reference_corruption(tokens, key, spans):
    """seq2seq's one-window path: (encoder ids, target ids), EOS-terminated."""
    mask = noise_mask(len(tokens), *spans.noise, np.random.default_rng(key))
    encoder = [*replace_spans(np.array(tokens), mask, spans.sentinels), spans.eos_id]
    return encoder, [*replace_spans(np.array(tokens), ~mask, spans.sentinels), spans.eos_id]


def padded(ids, length):
    return np.pad(np.asarray(ids), (0, length - len(ids)))


def test_span_corruption_stream_matches_a_per_lane_reference(files):
    cfg = kind_config(files, "span_corruption")
    bundle = pipeline.build_data(cfg)
    spans, tokenizer = bundle.train.spans, bundle.tokenizer
    raw = spans.raw_len
    steps = 30
    batches = [next(bundle.train) for _ in range(steps)]
    documents = train_documents(cfg)
    for lane in range(BATCH):
        tagged = lane_tokens(tokenizer, documents, lane, epochs=12)
        assert len(tagged) >= steps * raw
        for step, batch in enumerate(batches):
            window = tagged[step * raw : (step + 1) * raw]
            _, epoch, index, offset = window[0]
            key = [_SEED_TAG, SEED, epoch, index, offset]
            encoder, targets = reference_corruption([t for t, *_ in window], key, spans)
            np.testing.assert_array_equal(
                batch["encoder_inputs"][lane], padded(encoder, cfg.train.seq_len)
            )
            np.testing.assert_array_equal(
                batch["targets"][lane], padded(targets, spans.decoder_len)
            )
            np.testing.assert_array_equal(batch["inputs"][lane, 1:], batch["targets"][lane, :-1])
            assert batch["weights"][lane].sum() == len(targets)
            assert batch["example_ids"][lane] == index
    assert {b["encoder_inputs"].shape for b in batches} == {(BATCH, cfg.train.seq_len)}


def test_streamed_mixture_matches_a_per_lane_reference(files):
    cfg = kind_config(files, "mixture")
    bundle = pipeline.build_data(cfg)
    tokenizer, seq_len = bundle.tokenizer, cfg.train.seq_len
    sources = [
        train_documents(pipeline.component_config(cfg, f"jsonl:{files}/{s}/*.jsonl")) for s in "ab"
    ]
    lanes = {
        (k, lane): [t for t, *_ in lane_tokens(tokenizer, docs, lane, epochs=20)]
        for k, docs in enumerate(sources)
        for lane in range(BATCH)
    }
    taken = dict.fromkeys(lanes, 0)
    offset = {0: 0, 1: len(sources[0])}
    picked = []
    for step in range(40):
        batch = next(bundle.train)
        choice = np.random.default_rng([SEED, step, _CHOICE_TAG]).choice(2, BATCH, p=[0.6, 0.4])
        picked += list(choice)
        for lane, k in enumerate(choice):
            start = taken[k, lane] * seq_len
            window = lanes[k, lane][start : start + seq_len + 1]
            taken[k, lane] += 1
            np.testing.assert_array_equal(batch["inputs"][lane], window[:-1])
            np.testing.assert_array_equal(batch["targets"][lane], window[1:])
            ids = batch["example_ids"][lane] - offset[k]
            assert 0 <= ids < len(sources[k])
    assert 0.45 < np.mean(np.array(picked) == 0) < 0.75
    assert list(bundle.eval_sets) == ["a", "b"]


def test_document_examples_match_a_per_document_reference(files):
    for kind in ("curriculum", "span_corruption_curriculum"):
        cfg = kind_config(files, kind)
        bundle = pipeline.build_data(cfg)
        examples, tokenizer = bundle.train.examples, bundle.tokenizer
        documents = train_documents(cfg)
        assert len(examples) == bundle.num_train_examples == len(documents)
        ids = np.array([5, -1, 0, len(documents) - 1, 17])
        batch = examples.batch(ids)
        np.testing.assert_array_equal(batch["example_ids"], ids)
        for row, index in enumerate(ids):
            if index < 0:
                assert not batch["weights"][row].any()
                continue
            tokens = [tokenizer.bos_id, *tokenizer.encode(documents[index]), tokenizer.eos_id]
            if kind == "curriculum":
                tokens = tokens[: cfg.train.seq_len + 1]
                np.testing.assert_array_equal(batch["inputs"][row][: len(tokens) - 1], tokens[:-1])
                np.testing.assert_array_equal(batch["targets"][row][: len(tokens) - 1], tokens[1:])
                assert batch["weights"][row].sum() == len(tokens) - 1
                continue
            spans = examples.spans
            key = [_SEED_TAG, SEED, _DOCUMENT_TAG, int(index)]
            encoder, targets = reference_corruption(tokens[: spans.raw_len], key, spans)
            np.testing.assert_array_equal(
                batch["encoder_inputs"][row], padded(encoder, cfg.train.seq_len)
            )
            np.testing.assert_array_equal(batch["targets"][row], padded(targets, spans.decoder_len))
            assert batch["weights"][row].sum() == len(targets)


def fake_allgather(*iterators):
    """What process_allgather gives: one array per process, stacked."""
    return lambda local: np.stack([np.asarray(i.get_state()["lanes"]) for i in iterators])


def saved_state(train, *processes):
    """The state a checkpoint stores (gathered over `processes` for a stream), via JSON."""
    state = train.get_state()
    if hasattr(train, "gather_state"):
        state = train.gather_state(state, fake_allgather(*(processes or (train,))))
    return json.loads(json.dumps(state))


@pytest.mark.parametrize("kind", list(KINDS))
def test_resume_and_two_processes_reproduce_the_one_process_batches(files, kind):
    cfg = kind_config(files, kind)
    full = pipeline.build_data(cfg).train
    expected = [next(full) for _ in range(24)]
    cut = pipeline.build_data(cfg).train
    for _ in range(9):
        next(cut)
    state = saved_state(cut)
    halves = [pipeline.build_data(cfg, p, 2).train for p in (0, 1)]
    for half in halves:
        half.set_state(state)
    seen = [set(), set()]
    for step in range(9, 24):
        parts = [next(half) for half in halves]
        for key, value in expected[step].items():  # bit for bit
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), value, key)
        for p, part in enumerate(parts):
            seen[p] |= set(part["example_ids"].tolist())
    # The halves' state, gathered, is the one-process state after the same steps.
    assert saved_state(halves[0], *halves) == saved_state(full)
    if "curriculum" in kind:  # disjoint documents in every step (TrainBatches' rows)
        for step in range(9, 24):
            assert len(set(expected[step]["example_ids"].tolist())) == BATCH
    else:  # each lane reads its own documents of an epoch: disjoint within epoch 0
        fresh = [pipeline.build_data(cfg, p, 2).train for p in (0, 1)]
        firsts, steps = [set(), set()], 0
        while all(np.max(np.asarray(h.get_state()["lanes"])[..., 0]) == 0 for h in fresh):
            for p, half in enumerate(fresh):
                firsts[p] |= set(next(half)["example_ids"].tolist())
            steps += 1
        assert steps >= 1 and not firsts[0] & firsts[1]


def test_bad_combinations_name_the_culprit(files):
    cfg = kind_config(files, "mixture")
    cfg.data.curriculum = "paper"
    with pytest.raises(ValueError, match=r"cannot be combined with data\.mixture"):
        pipeline.build_data(cfg)
    cfg = config(files, "train.batch_size=64")
    with pytest.raises(ValueError, match=r"fewer than the train\.batch_size=64"):
        pipeline.build_data(cfg)
    cfg = config(files, "train.batch_size=48", MIXTURE.format(files))
    with pytest.raises(ValueError, match=r"data.mixture source 'jsonl:.*/b/\*.jsonl': .*48 lanes"):
        pipeline.build_data(cfg)
    state = saved_state(pipeline.build_data(kind_config(files, "span_corruption")).train)
    with pytest.raises(ValueError, match="cannot resume a streamed mixture"):
        pipeline.build_data(kind_config(files, "mixture")).train.set_state(state)
