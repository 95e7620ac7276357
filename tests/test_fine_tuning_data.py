"""Fine-tuning data (data.format, data.packing=documents): records of jsonl and parquet files
become whole examples packed into windows, from the prepared cache and streamed alike.

References: the examples each record must give, built here with the `tokenizers` library
itself (prompt ids, completion ids, EOS; per-token weights by hand), and the rows unpacked
back into examples by their segment ids: every example must come back exactly once, whole,
with positions counting from its start and loss weights exactly on its scored tokens.
"""

import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers

from jaxmoe.data import document_packing as dp
from jaxmoe.data.sources import load_tokenizer
from jaxmoe.errors import ConfigError
from tests.fixtures_data import build_data, split_examples
from tests.helpers import TINY_T5, tiny_config
from tests.test_data_sources import CONFIG, build_bpe

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "packing",
         "many", "short", "examples"]  # fmt: skip


def sentence(rng, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS, rng.integers(low, high)))


def records(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"question": f"q{i}: " + sentence(rng, 1, 6), "answer": sentence(rng, 1, 9), "id": i}
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    return folder, build_bpe(folder, CONFIG)  # BOS <s> by its post-processor, EOS </s>


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"jsonl:{path}"


def config_for(tmp_path, source, tokenizer_dir, *overrides, seq_len=32):
    return tiny_config(
        f"data.source={source}",
        f"data.tokenizer={tokenizer_dir}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.validation_fraction=0.2",
        f"train.seq_len={seq_len}",
        "train.batch_size=2",
        "model.vocab_size=0",
        *overrides,
    )


def expected_prompt_completion(tok: tokenizers.Tokenizer, record: dict):
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    prompt = [bos, *tok.encode(record["question"], add_special_tokens=False).ids]
    completion = [*tok.encode(record["answer"], add_special_tokens=False).ids, eos]
    return prompt + completion, [0] * len(prompt) + [1] * len(completion)


def unpack(batch) -> list[tuple]:
    """(inputs, targets, weights) of every document of every row, by segment id."""
    out = []
    for r in range(len(batch["inputs"])):
        segments = batch["segment_ids"][r]
        assert np.all(batch["weights"][r][segments == 0] == 0)  # padding is never scored
        for k in range(1, int(segments.max(initial=0)) + 1):
            at = np.flatnonzero(segments == k)
            assert np.all(np.diff(at) == 1)  # a document is one run
            np.testing.assert_array_equal(batch["positions"][r][at], np.arange(len(at)))
            out.append(
                tuple(tuple(batch[f][r][at].tolist()) for f in ("inputs", "targets", "weights"))
            )
    return out


def as_example(ids, weights) -> tuple:
    return (tuple(ids[:-1]), tuple(ids[1:]), tuple(float(w) for w in weights[1:]))


def all_windows(config, tokenizer, split_key):
    examples = split_examples(config, tokenizer, split_key, partial_last=True)
    return examples, examples.batch(np.arange(len(examples)))


def both_splits(config) -> tuple[list, dict]:
    """The examples of both splits, unpacked, and their packings' counts added up."""
    tokenizer, examples, counts = load_tokenizer(config.data), [], Counter()
    for split_key in ("train_split", "eval_split"):
        windows, batch = all_windows(config, tokenizer, split_key)
        examples += unpack(batch)
        counts.update(windows.counts)
    return examples, counts


def test_prompt_completion_jsonl_and_parquet_pack_whole_examples(bpe, tmp_path, capsys):
    folder, tok = bpe
    rows = records(60)
    jsonl = write_jsonl(tmp_path / "qa.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "qa.parquet")
    keys = (
        "data.format=prompt_completion",
        "data.prompt_key=question",
        "data.completion_key=answer",
    )
    want = Counter(as_example(*expected_prompt_completion(tok, r)) for r in rows)
    got_by_source = {}
    for source in (jsonl, f"parquet:{tmp_path / 'qa.parquet'}"):
        config = config_for(tmp_path, source, folder, *keys, seq_len=64)
        tokenizer = load_tokenizer(config.data)
        got = Counter()
        for split_key in ("train_split", "eval_split"):
            windows, batch = all_windows(config, tokenizer, split_key)
            assert batch["inputs"].shape == (len(windows), 64)
            got.update(unpack(batch))
        assert got == want  # every record once, whole, scored on its completion and EOS
        got_by_source[source] = batch
    assert "examples in" in capsys.readouterr().out  # the packing line, padding share
    jsonl_batch, parquet_batch = got_by_source.values()
    for key in jsonl_batch:
        np.testing.assert_array_equal(jsonl_batch[key], parquet_batch[key])


def test_truncation_left_cuts_the_prompt_drop_counts(bpe, tmp_path, capsys):
    folder, tok = bpe
    long_prompt = {"prompt": " ".join(["fox"] * 40), "completion": "the dog"}
    long_completion = {"prompt": "a", "completion": " ".join(["lazy"] * 40)}
    short = [{"prompt": f"the {i}", "completion": "quick"} for i in range(12)]
    source = write_jsonl(tmp_path / "long.jsonl", [long_prompt, long_completion, *short])
    for truncation in ("left", "drop"):
        config = config_for(
            tmp_path, source, folder, "data.format=prompt_completion",
            f"data.truncation={truncation}", f"data.cache_dir={tmp_path / truncation}", seq_len=16,
        )  # fmt: skip
        examples, counts = both_splits(config)
        out = capsys.readouterr().out
        assert "dropped" in out  # the packing lines name the counts
        if truncation == "left":
            assert (len(examples), counts["cut"], counts["dropped"]) == (13, 1, 1)
            ids, weights = expected_prompt_completion(
                tok, {"question": long_prompt["prompt"], "answer": "the dog"}
            )
            assert as_example(ids[-17:], weights[-17:]) in examples  # its end: 16 predictions
        else:
            assert (len(examples), counts["cut"], counts["dropped"]) == (12, 0, 2)


def test_streaming_packs_the_same_examples(bpe, tmp_path):
    folder, tok = bpe
    rows = records(40, seed=3)
    source = write_jsonl(tmp_path / "qa.jsonl", rows)
    keys = (
        "data.format=prompt_completion",
        "data.prompt_key=question",
        "data.completion_key=answer",
    )
    config = config_for(
        tmp_path, source, folder, *keys, "data.streaming=true", "data.prefetch=0", seq_len=64
    )
    data = build_data(config)
    train_docs = {as_example(*expected_prompt_completion(tok, r)) for r in rows}
    seen = Counter()
    for _ in range(20):  # the 2 lanes read their documents in order, whole examples per row
        seen.update(unpack(next(data.train)))
    assert set(seen) <= train_docs and len(seen) >= 20
    state = data.train.get_state()
    after = next(data.train)
    data.train.set_state(state)  # resumes at the example that did not fit
    again = next(data.train)
    for key in after:
        np.testing.assert_array_equal(after[key], again[key])


def test_seq2seq_packs_both_sides_with_t5x_segments(bpe, tmp_path):
    folder, tok = bpe
    rows = records(30, seed=5)
    source = write_jsonl(tmp_path / "s2s.jsonl", rows)
    config = config_for(
        tmp_path, source, folder, *TINY_T5, "data.format=seq2seq", "data.inputs_key=question",
        "data.targets_key=answer", "data.targets_len=40",
    )  # fmt: skip
    tokenizer, got = load_tokenizer(config.data), Counter()
    for split_key in ("train_split", "eval_split"):
        _, batch = all_windows(config, tokenizer, split_key)
        got.update(seq2seq_examples(batch))
    assert batch["encoder_inputs"].shape[1] == 32 and batch["inputs"].shape[1] == 40
    eos = tok.token_to_id("</s>")
    want = Counter(
        (tuple([*tok.encode(r["question"], add_special_tokens=False).ids, eos]),
         tuple([*tok.encode(r["answer"], add_special_tokens=False).ids, eos]))
        for r in rows
    )  # fmt: skip
    assert got == want


def seq2seq_examples(batch) -> Counter:
    """(encoder ids, target ids) of every document of every packed row."""
    got = Counter()
    for r in range(len(batch["inputs"])):
        for k in range(1, int(batch["segment_ids"][r].max()) + 1):
            enc = batch["encoder_inputs"][r][batch["encoder_segment_ids"][r] == k]
            at = batch["segment_ids"][r] == k
            targets, inputs = batch["targets"][r][at], batch["inputs"][r][at]
            np.testing.assert_array_equal(inputs, [0, *targets[:-1]])  # shifted per document
            assert np.all(batch["weights"][r][at] == 1)
            got[(tuple(enc.tolist()), tuple(targets.tolist()))] += 1
    return got


def test_best_fit_respects_the_window_and_packs_tightly():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, 500)
    window = dp.best_fit(lengths, 64)
    loads = np.bincount(window, weights=lengths)
    assert loads.max() <= 64
    assert window.max() + 1 <= 1.05 * np.ceil(lengths.sum() / 64) + 1
    second = rng.integers(1, 20, 500)
    window = dp.best_fit(lengths, 64, second, 24)
    assert np.bincount(window, weights=lengths).max() <= 64
    assert np.bincount(window, weights=second).max() <= 24


@pytest.mark.parametrize(
    ("overrides", "culprit"),
    [
        (("data.format=chat", "data.packing=concat", "data.source=jsonl:x"), "data.packing=concat"),
        (("data.format=seq2seq", "data.source=jsonl:x"), "needs model.arch=encoder_decoder"),
        ((*TINY_T5, "data.format=chat", "data.source=jsonl:x"), "model.arch=encoder_decoder reads"),
        (("data.format=chat", "data.source=jsonl:x", "data.shards=2"), "data.shards=2"),
        (("data.packing=documents", "data.workers=2"), "with data.workers=2"),
    ],
)
def test_impossible_combinations_are_one_line(overrides, culprit):
    with pytest.raises(ConfigError, match=culprit.replace("(", r"\(")):
        tiny_config(*overrides)


def test_bad_records_name_the_line_and_field(bpe, tmp_path):
    folder, _ = bpe
    config = config_for(tmp_path, "embedded", folder, "data.format=chat")
    with pytest.raises(ValueError, match=r"^data.format='chat' reads records of jsonl:GLOB"):
        build_data(config)
    source = write_jsonl(
        tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}]
    )
    config = config_for(tmp_path, source, folder, "data.format=chat", "data.chat_template=chatml")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: field 'messages'.*no assistant message"):
        build_data(config)
    source = write_jsonl(tmp_path / "bad2.jsonl", [{"prompt": "a", "answer": "b"}])
    config = config_for(tmp_path, source, folder, "data.format=prompt_completion")
    with pytest.raises(
        ValueError, match=r"bad2\.jsonl:1: no field data\.completion_key='completion'"
    ):
        build_data(config)
