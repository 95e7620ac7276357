"""Streaming for every objective (`data.streaming=True`): span corruption, mixtures and the
curriculum, on tiny jsonl files and a byte-level BPE tokenizer on disk.

References: per-lane Python loops over documents shuffled by np.random.default_rng, each
document tokenized on its own, and seq2seq's one-window noise_mask / replace_spans (tested by
hand in test_seq2seq.py); the mixture's row choice drawn again with np.random.default_rng.
"""

import json

import numpy as np
import pytest

from jaxmoe.data.mixture import _CHOICE_TAG, component_data
from jaxmoe.data.seq2seq import SPAN_SEED_TAG, noise_mask, replace_spans
from jaxmoe.data.stream_objectives import _DOCUMENT_TAG
from tests.fixtures_data import build_data
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


def train_documents(data) -> list[str]:
    from jaxmoe.data.sources import open_split

    return list(open_split(data, "train_split").documents)


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
    bundle = build_data(cfg)
    spans, tokenizer = bundle.train.spans, bundle.tokenizer
    raw = spans.raw_len
    steps = 30
    batches = [next(bundle.train) for _ in range(steps)]
    documents = train_documents(cfg.data)
    for lane in range(BATCH):
        tagged = lane_tokens(tokenizer, documents, lane, epochs=12)
        assert len(tagged) >= steps * raw
        for step, batch in enumerate(batches):
            window = tagged[step * raw : (step + 1) * raw]
            _, epoch, index, offset = window[0]
            key = [SPAN_SEED_TAG, SEED, epoch, index, offset]
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
    bundle = build_data(cfg)
    tokenizer, seq_len = bundle.tokenizer, cfg.train.seq_len
    sources = [
        train_documents(component_data(cfg.data, f"jsonl:{files}/{s}/*.jsonl")) for s in "ab"
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
        bundle = build_data(cfg)
        examples, tokenizer = bundle.train.examples, bundle.tokenizer
        documents = train_documents(cfg.data)
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
            key = [SPAN_SEED_TAG, SEED, _DOCUMENT_TAG, int(index)]
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
    full = build_data(cfg).train
    expected = [next(full) for _ in range(24)]
    cut = build_data(cfg).train
    for _ in range(9):
        next(cut)
    state = saved_state(cut)
    halves = [build_data(cfg, p, 2).train for p in (0, 1)]
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
        fresh = [build_data(cfg, p, 2).train for p in (0, 1)]
        firsts, steps = [set(), set()], 0
        while all(np.max(np.asarray(h.get_state()["lanes"])[..., 0]) == 0 for h in fresh):
            for p, half in enumerate(fresh):
                firsts[p] |= set(next(half)["example_ids"].tolist())
            steps += 1
        assert steps >= 1 and not firsts[0] & firsts[1]


def test_bad_combinations_name_the_culprit(files):
    cfg = kind_config(files, "mixture")
    cfg = cfg.replace(data=cfg.data.replace(curriculum="paper"))
    with pytest.raises(ValueError, match=r"cannot be combined with data\.mixture"):
        build_data(cfg)
    cfg = config(files, "train.batch_size=64")
    with pytest.raises(ValueError, match=r"fewer than the train\.batch_size=64"):
        build_data(cfg)
    cfg = config(files, "train.batch_size=48", MIXTURE.format(files))
    with pytest.raises(ValueError, match=r"data.mixture source 'jsonl:.*/b/\*.jsonl': .*48 lanes"):
        build_data(cfg)
    state = saved_state(build_data(kind_config(files, "span_corruption")).train)
    with pytest.raises(ValueError, match="cannot resume a streamed mixture"):
        build_data(kind_config(files, "mixture")).train.set_state(state)


@pytest.mark.slow
def test_streamed_curriculum_orders_documents_and_resumes_exactly(files, tmp_path):
    """10 steps of 8 of the 58 train documents (7 steps an epoch), cut at step 4 and resumed
    across the epoch boundary: the same losses and the same epoch-1 order of documents."""
    from jaxmoe.training.loop import train
    from tests.test_train import read_metrics

    def run(workdir, steps):
        cfg = config(
            files,
            "data.curriculum=paper",
            f"train.steps={steps}",
            "train.checkpoint_every=4",
            "train.log_every=1",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.max_to_keep=10",
            "optimizer.schedule=constant",
            "optimizer.warmup_steps=0",
        )
        train(cfg, str(workdir), progress=False)
        return cfg

    cfg = run(tmp_path / "full", 10)
    run(tmp_path / "cut", 4)
    run(tmp_path / "cut", 10)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    for step in range(5, 11):
        assert cut[step]["loss"] == pytest.approx(full[step]["loss"], abs=1e-6), step

    def load(workdir, kind):
        return np.load(workdir / "curriculum" / f"epoch_000001.{kind}.npy")

    documents = train_documents(cfg.data)
    order = load(tmp_path / "full", "order")
    np.testing.assert_array_equal(order, load(tmp_path / "cut", "order"))
    assert sorted(order.tolist()) == list(range(len(documents)))  # keyed by document
    frozen = load(tmp_path / "full", "frozen")
    kept = len(documents) // BATCH * BATCH  # epoch 0 trained each document once, but its tail
    dropped = np.random.default_rng([SEED, 0]).permutation(len(documents))[kept:]
    assert np.flatnonzero(~frozen["seen"]).tolist() == sorted(dropped.tolist())
    tokenizer = build_data(cfg).tokenizer
    for index, text in enumerate(documents):  # each document's real targets, every layer
        if index in dropped:
            continue
        length = min(len(tokenizer.encode(text)) + 2, cfg.train.seq_len + 1)
        assert frozen["tokens"][index].tolist() == [length - 1] * 2, index
    log = load(tmp_path / "full", "log")
    np.testing.assert_array_equal(log["id"][: 3 * BATCH], order[: 3 * BATCH])  # steps 8-10


def cli_args(files, workdir, steps, kind):
    """`jaxmoe train` flags of a tiny run streaming `kind` (span corruption of a mixture, or
    the curriculum over documents)."""
    model = [o for o in TINY_T5 if kind == "span_corruption_mixture"]
    extra = {
        "span_corruption_mixture": [MIXTURE.format(files)],
        "curriculum": ["data.curriculum=paper", "train.max_to_keep=10"],
    }[kind]
    flags = [
        "model.num_layers=2",
        "model.d_model=32",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.head_dim=8",
        "model.ffn_dim=64",
        "model.moe.ffn_dim=32",
        "model.moe.block_size=8",
        "model.vocab_size=0",
        f"train.batch_size={BATCH}",
        f"train.seed={SEED}",
        "train.seq_len=16",
        f"train.steps={steps}",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.checkpoint_every=4",
        "optimizer.schedule=constant",
        "optimizer.warmup_steps=0",
        "data.streaming=True",
        f"data.tokenizer={files}/tok",
        f"data.source=jsonl:{files}/a/*.jsonl",
        f"data.cache_dir={workdir}.cache",
        *model,
        *extra,
    ]
    head = ["train", "--config", "configs/default.py", "--workdir", str(workdir), "--no_progress"]
    return head + [f"--config.{flag}" for flag in flags]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["span_corruption_mixture", "curriculum"])
def test_two_processes_read_disjoint_rows_train_like_one_and_one_resumes(files, tmp_path, kind):
    """launch/local.sh 2 (2 processes x 4 devices) against one process of 8: per step, the
    processes' example ids (JAXMOE_DATA_TRACE) are disjoint and together the one-process
    batch; the losses agree; one process resumes the 2-process checkpoint exactly."""
    import subprocess
    import sys

    from tests.test_data_multihost import rows
    from tests.test_faults import ROOT, env, launch_two, losses

    one, two = tmp_path / "one", tmp_path / "two"
    single = subprocess.run(
        [sys.executable, "-m", "jaxmoe", *cli_args(files, one, 10, kind)],
        cwd=ROOT,
        env={**env(), "JAXMOE_DATA_TRACE": str(tmp_path / "trace1")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    multi = launch_two(cli_args(files, two, 8, kind), JAXMOE_DATA_TRACE=str(tmp_path / "trace2"))
    assert multi.returncode == 0, (multi.stdout + multi.stderr)[-3000:]
    reference, traced = rows(tmp_path / "trace1")[0], rows(tmp_path / "trace2")
    for step in range(8):
        first, second = traced[0][step], traced[1][step]
        assert len(first) == len(second) == BATCH // 2
        assert first + second == reference[step], step
    assert not set(traced[0][0]) & set(traced[1][0])  # the first windows: other documents
    expected, multi_losses = losses(one), losses(two)
    for step in range(1, 9):
        assert multi_losses[step] == pytest.approx(expected[step], abs=1e-5), step
    resumed = subprocess.run(  # the 2-process checkpoint of step 8, on one process
        [sys.executable, "-m", "jaxmoe", *cli_args(files, two, 10, kind)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for step in (9, 10):
        assert losses(two)[step] == pytest.approx(expected[step], abs=1e-5), step
