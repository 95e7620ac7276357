"""data.shards: each process tokenizes only the train shards it reads, into its own cache,
and the batches equal one process's (and a shared cache's).

References are independent of the code under test: shards rebuilt from the pydoc topics by a
per-document loop and sliced into windows by hand; the processes' batches against one
process's; in the slow test, two real processes on 127.0.0.1 with a cache each against one
shared cache and one process.
"""

import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from jaxmoe.config.validation import validate
from jaxmoe.data import shards
from jaxmoe.data.sources import load_tokenizer
from tests.fixtures_data import build_data, train_batches
from tests.helpers import tiny_config
from tests.test_data import reference_stream, take, topic_split

TOKENIZED = re.compile(r"data: process (\d+) reads train shard.*: tokenized (\d+) documents")


def config_in(cache, *overrides):
    fixed = ("data.shards=4", "data.prefetch=0", "train.seq_len=128")
    return tiny_config(*fixed, f"data.cache_dir={cache}", *overrides)


def tokenizer_only(prepared, target):
    """A copy of the prepared embedded cache without its train token stream: a host that
    has the tokenizer (and eval split) but has tokenized no train document."""
    shutil.copytree(prepared, target)
    for name in os.listdir(target / "tokens"):
        if name.startswith("train_"):
            os.remove(target / "tokens" / name)
    return target


def train_files(cache) -> dict[str, bytes]:
    folder = cache / "tokens"
    return {n: (folder / n).read_bytes() for n in os.listdir(folder) if n.startswith("train_")}


def reference_shards(tokenizer, count: int) -> list[np.ndarray]:
    """Each shard's stream by the documented rule: documents [s*D//S, (s+1)*D//S)."""
    docs = topic_split()[0]
    bounds = [s * len(docs) // count for s in range(count + 1)]
    return [reference_stream(tokenizer, docs[a:b]) for a, b in itertools.pairwise(bounds)]


class ThreadAllgather:
    """`allgather` for processes simulated by threads: stacks what each one sent. The
    threads take turns (`lock`: tfds's temporary folders are per process), except while
    they meet here."""

    def __init__(self, count: int):
        self.barrier, self.values = threading.Barrier(count, timeout=120), [None] * count
        self.lock = threading.Lock()

    def of(self, process: int):
        def allgather(value):
            self.values[process] = np.asarray(value)
            self.lock.release()
            self.barrier.wait()
            out = np.stack(self.values)
            self.barrier.wait()
            self.lock.acquire()
            return out

        return allgather


def build_processes(configs) -> tuple[list, list[str]]:
    """build_data for process p of len(configs) on configs[p], each on its own thread."""
    count, lines = len(configs), []
    gather, bundles, errors = ThreadAllgather(count), [None] * count, []

    def run(p):
        try:
            with gather.lock:
                bundles[p] = build_data(
                    configs[p], p, count, report=lines.append, allgather=gather.of(p)
                )
        except Exception as error:  # re-raised below, on the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(p,)) for p in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return bundles, lines


def tokenized(lines) -> dict[int, int]:
    return {int(m[1]): int(m[2]) for m in map(TOKENIZED.search, lines) if m}


def test_shards_are_the_split_cut_by_documents(embedded_data_cache, tmp_path):
    cache = tokenizer_only(embedded_data_cache, tmp_path / "cache")
    config = config_in(cache)
    tokenizer = load_tokenizer(config.data)
    lines = []
    batch_size = config.train.batch_size
    streams = shards.prepare_shards(config.data, batch_size, tokenizer, report=lines.append)
    expected = reference_shards(tokenizer, 4)
    assert sorted(streams) == [0, 1, 2, 3]
    for shard in range(4):
        np.testing.assert_array_equal(streams[shard], expected[shard], err_msg=str(shard))
    whole = reference_stream(tokenizer, topic_split()[0])
    np.testing.assert_array_equal(np.concatenate([streams[s] for s in range(4)]), whole)
    assert tokenized(lines) == {0: len(topic_split()[0])}
    # cached: nothing to do
    shards.prepare_shards(config.data, batch_size, tokenizer, report=lines.append)
    assert tokenized(lines[1:]) == {0: 0}


def test_two_processes_with_their_own_caches_read_one_process_batches(
    embedded_data_cache, tmp_path
):
    caches = [tokenizer_only(embedded_data_cache, tmp_path / f"c{p}") for p in range(3)]
    (one,), one_lines = build_processes([config_in(caches[2])])
    two, lines = build_processes([config_in(caches[0]), config_in(caches[1])])
    num_docs = len(topic_split()[0])
    # Process p tokenized its shards' documents, [p*D/2, (p+1)*D/2), and nothing else.
    assert tokenized(one_lines) == {0: num_docs}
    assert tokenized(lines) == {0: 2 * num_docs // 4, 1: num_docs - 2 * num_docs // 4}
    files = [train_files(cache) for cache in caches]
    assert len(files[0]) == len(files[1]) == 2 and len(files[2]) == 4
    assert {**files[0], **files[1]} == files[2]  # the union is what one process tokenized
    assert one.num_train_examples == two[0].num_train_examples == two[1].num_train_examples
    assert one.num_train_tokens == two[1].num_train_tokens

    tokenizer = one.tokenizer
    streams = reference_shards(tokenizer, 4)
    seq_len, per_shard = 128, 2  # train.batch_size=8 over 4 shards
    sizes = [(len(stream) - 1) // seq_len for stream in streams]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    steps = max(sizes) // per_shard + 2  # every shard into its second epoch
    seen = [[] for _ in range(4)]
    batches = [take(bundle.train, steps) for bundle in (*two, one)]
    for step, (a, b, whole) in enumerate(zip(*batches, strict=True)):
        for key in whole:
            np.testing.assert_array_equal(np.concatenate([a[key], b[key]]), whole[key], key)
        for row, example in enumerate(whole["example_ids"]):
            shard = row // per_shard
            local = int(example) - offsets[shard]
            assert 0 <= local < sizes[shard], (step, row)
            window = streams[shard][local * seq_len : local * seq_len + seq_len + 1]
            np.testing.assert_array_equal(whole["inputs"][row], window[:-1])
            np.testing.assert_array_equal(whole["targets"][row], window[1:])
            seen[shard].append(local)
    for shard in range(4):  # each epoch of a shard is a permutation of its windows
        first_epoch = seen[shard][: sizes[shard]]
        assert sorted(first_epoch) == list(range(sizes[shard])), shard
        assert first_epoch != sorted(first_epoch)  # shuffled


def test_span_corruption_shards(embedded_data_cache, tmp_path):
    from tests.test_seq2seq import reconstruct, unpadded

    caches = [tokenizer_only(embedded_data_cache, tmp_path / f"c{p}") for p in range(3)]
    t5 = ("model.arch=encoder_decoder", "model.moe.num_experts=0", "model.rope_theta=0.0")
    configs = [config_in(cache, *t5, "model.activation=gelu") for cache in caches]
    (one,), _ = build_processes(configs[2:])
    two, lines = build_processes(configs[:2])
    num_docs = len(topic_split()[0])
    assert tokenized(lines) == {0: 2 * num_docs // 4, 1: num_docs - 2 * num_docs // 4}
    streams = reference_shards(one.tokenizer, 4)
    raw = one.train.parts[0].raw_len
    offsets = np.concatenate([[0], np.cumsum([len(s) // raw for s in streams])[:-1]])
    first_sentinel = one.tokenizer.vocab_size + 99
    for a, b, whole in zip(*(take(x.train, 3) for x in (*two, one)), strict=True):
        assert "encoder_inputs" in whole
        for key in whole:
            np.testing.assert_array_equal(np.concatenate([a[key], b[key]]), whole[key], key)
        for row, example in enumerate(whole["example_ids"]):
            shard = row // 2
            local = int(example) - offsets[shard]
            window = streams[shard][local * raw : (local + 1) * raw].tolist()
            assert reconstruct(*unpadded(whole, row), first_sentinel) == window
    # Shards draw their masks apart: with one seed, window 0 of each would share its mask.
    shard_ids = np.array([0])
    masks = [
        one.train.parts[s].batch(shard_ids)["encoder_inputs"][0] > first_sentinel - 100
        for s in (0, 1)
    ]
    assert not np.array_equal(*masks)


def test_state_resumes_with_any_process_count(embedded_data_cache, tmp_path):
    cache = tokenizer_only(embedded_data_cache, tmp_path / "cache")
    config = config_in(cache)
    (one,), _ = build_processes([config])
    batches = take(one.train, 7)
    state = json.loads(json.dumps(one.train.get_state()))
    after = take(one.train, 3)
    two, _ = build_processes([config, config])
    for bundle in two:
        bundle.train.set_state(state)
    parts = [take(bundle.train, 3) for bundle in two]
    for whole, a, b in zip(after, *parts, strict=True):
        np.testing.assert_array_equal(np.concatenate([a["inputs"], b["inputs"]]), whole["inputs"])
    assert batches[0]["example_ids"].tolist() != after[0]["example_ids"].tolist()

    tokenizer = one.tokenizer
    unsharded = train_batches(tiny_config(f"data.cache_dir={cache}"), tokenizer)
    with pytest.raises(ValueError, match=r"saved without data\.shards; .*data\.shards=4"):
        one.train.set_state(unsharded.get_state())
    with pytest.raises(ValueError, match=r"shards=2 but this run has 4"):
        one.train.set_state({**state, "shards": 2})
    with pytest.raises(ValueError, match=r"shard_examples=.* changed since it was saved"):
        one.train.set_state({**state, "shard_examples": [1, 2, 3, 4]})


@pytest.mark.parametrize(
    "overrides, processes, message",
    [
        (("data.shards=4",), 3, r"data\.shards=4 must be a multiple of the process count 3"),
        (("data.shards=3",), 1, r"train\.batch_size=8 must be a multiple of data\.shards=3"),
        (("data.shards=2", "data.streaming=True"), 1, r"combined with data\.streaming=True"),
        (("data.shards=2", "data.mixture=embedded=1"), 1, r"combined with data\.mixture="),
        (("data.shards=2", "data.curriculum=paper"), 1, r"combined with data\.curriculum='paper'"),
    ],
)
def test_bad_shards_are_one_line_naming_the_key(overrides, processes, message, tmp_path):
    config = tiny_config(f"data.cache_dir={tmp_path}", *overrides)
    with pytest.raises(ValueError, match=message) as error:
        shards.check_shards(config.data, config.train.batch_size, processes)
    assert "\n" not in str(error.value)


def test_too_many_shards_and_negative_shards(embedded_data_cache, tmp_path):
    cache = tokenizer_only(embedded_data_cache, tmp_path / "cache")
    config = tiny_config(f"data.cache_dir={cache}", "data.shards=128", "train.batch_size=128")
    with pytest.raises(ValueError, match=r"data\.shards=128: train shard \d+ holds 0 tokens"):
        build_data(config)
    with pytest.raises(ValueError, match=r"data\.shards=-1 must be >= 0"):
        validate(tiny_config("data.shards=-1"))


def test_a_failing_process_still_meets_the_others(embedded_data_cache, tmp_path, monkeypatch):
    caches = [tokenizer_only(embedded_data_cache, tmp_path / f"c{p}") for p in range(2)]
    real = shards.shard_stream

    def failing(config, tokenizer, split, shard, count):
        if shard >= 2:
            raise OSError("No space left on device")
        return real(config, tokenizer, split, shard, count)

    monkeypatch.setattr(shards, "shard_stream", failing)
    gather, errors = ThreadAllgather(2), [None, None]

    def run(p):
        try:
            with gather.lock:
                config = config_in(caches[p])
                build_data(config, p, 2, report=print, allgather=gather.of(p))
        except Exception as error:
            errors[p] = error

    threads = [threading.Thread(target=run, args=(p,)) for p in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert isinstance(errors[1], OSError)
    assert str(errors[0]) == "process 1 could not prepare its train shards (see its log)"


def test_prepare_command_prepares_one_process_shards(embedded_data_cache, tmp_path, capsys):
    from jaxmoe.cli import main

    assert main(["prepare", "--process_id", "2", "--num_processes", "2"]) == 2
    assert main(["prepare", "--num_processes", "3", "--config.data.shards=4"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors == [
        "jaxmoe prepare: error: --process_id=2 is not below --num_processes=2",
        "jaxmoe prepare: error: data.shards=4 must be a multiple of the process count 3 "
        "(each process reads whole shards)",
    ]

    cache = tokenizer_only(embedded_data_cache, tmp_path / "cache")
    args = ["prepare", "--config", "configs/default.py", "--process_id", "1"]
    overrides = [f"--config.data.cache_dir={cache}", "--config.data.vocab_size=512"]
    assert main([*args, "--num_processes", "2", "--config.data.shards=4", *overrides]) == 0
    one = tokenizer_only(embedded_data_cache, tmp_path / "one")
    config = config_in(one)
    shards.prepare_shards(
        config.data, config.train.batch_size, load_tokenizer(config.data), report=lambda line: None
    )
    everything = train_files(one)
    mine = train_files(cache)
    assert len(mine) == 2 and {n: everything[n] for n in mine} == mine


# The real thing: processes on 127.0.0.1 through the CLI (launched here, not by
# launch/local.sh, so that each can have a data.cache_dir of its own).
def launch(count: int, caches, workdir, trace, steps: int = 3):
    from tests.test_faults import env, train_args

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for p in range(count):
        args = train_args(workdir, caches[p], steps, "--config.data.shards=4")
        if count > 1:
            args += [
                "--coordinator_address",
                f"127.0.0.1:{port}",
                "--num_processes",
                str(count),
                "--process_id",
                str(p),
            ]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "jaxmoe", *args],
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                env={**env(8 // count), "JAXMOE_DATA_TRACE": str(trace)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        logs.append(out)
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-3000:]
    return logs


def traced(trace) -> list[list[int]]:
    """Every step's global batch of example ids, the processes' rows joined in order."""
    names = sorted(os.listdir(trace), key=lambda n: int(n[5:-6]))  # rows_<p>.jsonl
    per_process = [[json.loads(x) for x in (trace / n).read_text().splitlines()] for n in names]
    return [[i for row in rows for i in row] for rows in zip(*per_process, strict=True)]


@pytest.mark.slow
def test_two_hosts_without_a_shared_cache(tmp_path):
    from tests.test_faults import losses

    steps = 3
    # Empty caches: each host trains its own tokenizer as well.
    own = [tmp_path / "own0", tmp_path / "own1"]
    two = launch(2, own, tmp_path / "two", tmp_path / "t2", steps)
    shared = launch(2, [tmp_path / "shared"] * 2, tmp_path / "three", tmp_path / "t3", steps)
    # One process, here: the same data as the runs' (tests/test_faults.TINY) on a third cache.
    fixed = ("data.shards=4", "data.prefetch=0", "train.seq_len=32")
    lines, config = [], tiny_config(*fixed, f"data.cache_dir={tmp_path / 'c1'}")
    one = build_data(config, report=lines.append)
    reference = [batch["example_ids"].tolist() for batch in take(one.train, steps)]

    assert traced(tmp_path / "t2") == reference and traced(tmp_path / "t3") == reference
    for step, loss in losses(tmp_path / "three").items():
        assert losses(tmp_path / "two")[step] == pytest.approx(loss, abs=1e-6), step
    counts = [tokenized(log.splitlines()) for log in (lines[0], *two)]
    total = len(topic_split()[0])
    assert counts == [{0: total}, {0: 2 * total // 4}, {1: total - 2 * total // 4}]
    files = [train_files(cache) for cache in (tmp_path / "c1", *own)]
    assert len(files[1]) == len(files[2]) == 2 and {**files[1], **files[2]} == files[0]
    # Without a shared cache each host prepared its own tokenizer (the same one).
    tokenizers = [sorted(os.listdir(cache / "tokenizers")) for cache in own]
    assert tokenizers[0] == tokenizers[1]
    assert "not see process 0's cache" in two[1]
    assert "WARNING" not in two[1] and "opens the cache prepared by process 0" in shared[1]
