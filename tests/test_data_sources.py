"""Sources and tokenizers users have: jsonl and parquet files, Hugging Face tokenizer.json.

References: the `tokenizers` library itself, JSON and Parquet files written here, token
streams rebuilt by a per-document Python loop.
"""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jaxmoe.data import corpus
from jaxmoe.data.hf_tokenizer import HFTokenizer
from jaxmoe.data.tokenizer import open_tokenizer
from tests.fixtures_data import build_data, split_examples
from tests.test_data import make_config

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Packing concatenates documents, separated by EOS.",
    "Unicode: naïve café, 日本語, emoji 🙂 and tabs\tand\nnewlines.",
    "  leading spaces and trailing ones  ",
] * 8


def documents(n: int, tag: str) -> list[str]:
    return [f"{tag} document {i}: " + TEXTS[i % len(TEXTS)] for i in range(n)]


def build_bpe(folder, config: dict | None, vocab_size: int = 400) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer trained on TEXTS with <pad>, </s>, <s> and a post-processor
    that puts <s> before every text (as Llama 3's does); saved as folder/tokenizer.json."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "</s>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS + documents(64, "x"), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


CONFIG = {"eos_token": "</s>", "pad_token": {"content": "<pad>"}}


def test_tokenizer_json_matches_the_tokenizers_library(tmp_path):
    reference = build_bpe(tmp_path / "tok", CONFIG)
    for path in (tmp_path / "tok", tmp_path / "tok" / "tokenizer.json"):
        ours = open_tokenizer(str(path))
        assert isinstance(ours, HFTokenizer)
        assert ours.vocab_size == reference.get_vocab_size()
        for text in TEXTS[:4]:
            ids = reference.encode(text, add_special_tokens=False).ids
            assert ours.encode(text) == ids
            assert ours.decode(ids) == reference.decode(ids)
            assert ours.decode(ours.encode(text)) == text  # byte-level BPE is lossless
        assert ours.encode_batch(TEXTS[:4]) == [
            e.ids for e in reference.encode_batch(TEXTS[:4], add_special_tokens=False)
        ]
        # Special ids from tokenizer_config.json; BOS from the post-processor's template.
        assert ours.eos_id == reference.token_to_id("</s>")
        assert ours.pad_id == reference.token_to_id("<pad>")
        assert ours.bos_id == reference.token_to_id("<s>")
        assert reference.encode("a").ids[0] == ours.bos_id
        assert ours.decode([ours.bos_id, *ours.encode("hi"), ours.eos_id]) == "hi"


def test_add_bos_token_in_the_config_decides(tmp_path):
    build_bpe(tmp_path / "off", {**CONFIG, "add_bos_token": False})
    assert open_tokenizer(str(tmp_path / "off")).bos_id is None
    build_bpe(tmp_path / "on", {**CONFIG, "add_bos_token": True, "bos_token": "</s>"})
    on = open_tokenizer(str(tmp_path / "on"))
    assert on.bos_id == on.eos_id  # the config's choice, not the template's <s>


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "does not exist"),
        ("empty_dir", "has no tokenizer.json"),
        ("not_json", "is not a Hugging Face tokenizer.json"),
        ("unknown_eos", "eos_token '<eos>' is not in its vocabulary"),
    ],
)
def test_bad_tokenizer_json_gives_one_line_errors(tmp_path, setup, message):
    path = tmp_path / "tok"
    if setup == "empty_dir":
        path.mkdir()
    elif setup == "not_json":
        path.mkdir()
        (path / "tokenizer.json").write_text("{not json")
    elif setup == "unknown_eos":
        build_bpe(path, {"eos_token": "<eos>"})
    with pytest.raises(ValueError, match=message) as error:
        open_tokenizer(str(path))
    assert "\n" not in str(error.value)


def write_jsonl(path, texts, key="text"):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({key: t, "id": i}) for i, t in enumerate(texts)]
    path.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n")


def reference_split(texts, split):
    """The documented rule: a text goes to validation when its hash falls below 5%."""
    return [t for t in texts if corpus.in_validation(t, 0.05) == (split == "validation")]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_record_sources_feed_packing(tmp_path, kind):
    texts = [*documents(60, "a"), ""]
    folder = tmp_path / "files"
    folder.mkdir()
    if kind == "jsonl":
        write_jsonl(folder / "b.jsonl", texts[30:], key="body")
        write_jsonl(folder / "a.jsonl", texts[:30], key="body")
    else:
        pq.write_table(pa.table({"body": texts[30:]}), folder / "b.parquet")
        pq.write_table(pa.table({"body": texts[:30]}), folder / "a.parquet")
    build_bpe(tmp_path / "tok", CONFIG)
    config = make_config(
        tmp_path / "cache",
        data__source=f"{kind}:{folder}/*.{kind}",
        data__text_key="body",
        data__tokenizer=str(tmp_path / "tok"),
        train__seq_len=16,
    )
    tok = open_tokenizer(str(tmp_path / "tok"))
    for split_key, split in (("train_split", "train"), ("eval_split", "validation")):
        expected = []
        for text in reference_split(texts[:-1], split):  # the empty text is skipped
            expected += [tok.bos_id, *tok.encode(text), tok.eos_id]
        stream = split_examples(config, tok, split_key, partial_last=True).tokens_N
        np.testing.assert_array_equal(stream, expected)


def test_record_source_errors_name_the_culprit(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["fine", "also fine"], key="content")
    config = make_config(tmp_path / "cache", data__source=f"jsonl:{tmp_path}/*.jsonl")
    with pytest.raises(ValueError, match=r"a.jsonl:1: no field data.text_key='text'"):
        build_data(config)
    config = make_config(tmp_path / "cache", data__source=f"jsonl:{tmp_path}/none*.jsonl")
    with pytest.raises(ValueError, match="matches no files"):
        build_data(config)


@pytest.mark.slow
def test_jsonl_source_with_hf_tokenizer_trains_evaluates_and_decodes(tmp_path):
    from jaxmoe.config.stored import read_config
    from jaxmoe.inference.decode_text import decode_main
    from jaxmoe.training.loop import train
    from tests.helpers import tiny_config

    write_jsonl(tmp_path / "data" / "part.jsonl", documents(400, "t"))
    build_bpe(tmp_path / "tok", CONFIG)
    config = tiny_config(
        "model.moe.num_experts=0",
        "train.steps=6",
        "train.eval_every=0",
        "train.eval_batches=2",
        "model.vocab_size=0",
        f"data.source=jsonl:{tmp_path}/data/*.jsonl",
        f"data.tokenizer={tmp_path}/tok/tokenizer.json",
        f"data.cache_dir={tmp_path}/cache",
    )
    summary = train(config, str(tmp_path / "run"), progress=False)
    assert np.isfinite(summary["eval"]["loss"])
    checkpoint = str(tmp_path / "run" / "checkpoints" / "6")
    trained = read_config(checkpoint).model  # model.vocab_size=0 took the tokenizer's
    assert trained.vocab_size >= open_tokenizer(str(tmp_path / "tok")).vocab_size
    result = decode_main(
        checkpoint,
        prompt="The quick",
        max_new_tokens=4,
        print_fn=lambda *_: None,
    )
    assert len(result["texts"]) == 1 and result["new_tokens"] > 0


def test_t5_sentinels_come_from_the_tokenizer(tmp_path):
    from jaxmoe.data.seq2seq import tokenizer_sentinels

    build_bpe(tmp_path / "tok", {**CONFIG, "add_bos_token": False})
    reference = tokenizers.Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    # T5's tokenizer.json lists <extra_id_99> ... <extra_id_0> after the pieces.
    reference.add_special_tokens([f"<extra_id_{k}>" for k in reversed(range(100))])
    reference.save(str(tmp_path / "tok" / "tokenizer.json"))
    tok = open_tokenizer(str(tmp_path / "tok"))
    expected = [reference.token_to_id(f"<extra_id_{k}>") for k in range(100)]
    np.testing.assert_array_equal(tokenizer_sentinels(tok), expected)
    write_jsonl(tmp_path / "data" / "a.jsonl", documents(200, "t"))
    config = make_config(
        tmp_path / "cache",
        data__source=f"jsonl:{tmp_path}/data/*.jsonl",
        data__tokenizer=str(tmp_path / "tok"),
        model__arch="encoder_decoder",
    )
    bundle = build_data(config)
    assert bundle.vocab_size == tok.vocab_size  # no ids added above the vocabulary
    batch = next(bundle.train)
    first = batch["targets"][:, 0]  # every target sequence starts with sentinel 0
    np.testing.assert_array_equal(first, reference.token_to_id("<extra_id_0>"))
    assert set(batch["encoder_inputs"][batch["encoder_inputs"] >= min(expected)]) <= set(expected)


def test_compile_check_takes_the_vocabulary_train_would(tmp_path):
    from jaxmoe.aot.compile_check import model_vocab_size
    from tests.helpers import tiny_config

    config = tiny_config("model.vocab_size=0", "data.vocab_size=512")
    assert model_vocab_size(config) == 512
    config = tiny_config("model.vocab_size=0", "model.arch=encoder_decoder")
    assert model_vocab_size(config) == 512 + 100  # T5's extra ids above the vocabulary
    build_bpe(tmp_path / "tok", CONFIG)
    config = tiny_config("model.vocab_size=0", f"data.tokenizer={tmp_path}/tok")
    assert (
        model_vocab_size(config)
        == tokenizers.Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json")).get_vocab_size()
    )
