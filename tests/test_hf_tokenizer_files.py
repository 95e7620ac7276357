"""Tokenizers travel with the model: `convert hf` keeps the source's tokenizer files and
jaxmoe uses them (BOS from the post-processor, every EOS id of generation_config.json);
`export hf` writes tokenizer files that AutoTokenizer loads, with the special-token ids in
config.json / generation_config.json equal to the tokenizer's. The reference throughout is
transformers: its tokenizer, and its greedy `generate` on the same weights."""

import io
import json
import logging
import shutil

import pytest
import sentencepiece as spm
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from jaxmoe.checkpoints.manager import CheckpointError, save_params
from jaxmoe.config.loading import with_overrides
from jaxmoe.config.stored import inherit_tokenizer, read_config
from jaxmoe.conversions.hf.exporter import export_hf
from jaxmoe.conversions.hf.importer import convert_hf
from jaxmoe.conversions.surgery import convert_gqa
from jaxmoe.data.sources import load_tokenizer
from jaxmoe.data.tokenizer import Tokenizer, open_tokenizer, train_sentencepiece
from jaxmoe.inference.decode_text import decode_main
from tests.helpers import tiny_config, unit_scale_params
from tests.test_data_sources import build_bpe
from tests.test_hf import randomize

PROMPT = "The quick brown fox"
MESH = ["--config.mesh.data=-1"]


def hf_greedy(model, ids: list[int], max_new: int) -> list[int]:
    """transformers' greedy continuation, stopping at its generation_config's EOS ids."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(ids) :].tolist()


def jaxmoe_decode(checkpoint, max_new: int, prompt: str = PROMPT) -> dict:
    lines: list[str] = []
    result = decode_main(
        str(checkpoint), prompt=prompt, max_new_tokens=max_new, overrides=MESH,
        print_fn=lines.append,
    )  # fmt: skip
    return result | {"ended": lines[0].endswith("[EOS]")}


@pytest.fixture(scope="module")
def hf_llama_with_tokenizer(tmp_path_factory):
    """A random Llama saved with a BPE tokenizer whose post-processor adds <s>, and a
    generation_config.json whose second EOS id is the 4th token greedy decoding makes."""
    src = tmp_path_factory.mktemp("hf_llama_tok")
    tok_config = {"eos_token": "</s>", "bos_token": "<s>", "pad_token": "<pad>",
                  "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    build_bpe(src, tok_config)
    config = LlamaConfig(
        vocab_size=400, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=2, eos_token_id=1,
        pad_token_id=0,
    )  # fmt: skip
    model = randomize(LlamaForCausalLM(config), seed=11)
    ids = AutoTokenizer.from_pretrained(src)(PROMPT).input_ids
    free = hf_greedy(model, ids, 8)
    stop = free[3]
    assert stop not in free[:3] and 1 not in free[:4], free
    model.generation_config.eos_token_id = [1, stop]
    model.generation_config.bos_token_id, model.generation_config.pad_token_id = 2, 0
    model.save_pretrained(src)
    assert json.loads((src / "generation_config.json").read_text())["eos_token_id"] == [1, stop]
    return src, stop


def test_converted_checkpoint_keeps_and_uses_its_tokenizer(hf_llama_with_tokenizer, tmp_path):
    src, stop = hf_llama_with_tokenizer
    convert_hf(str(src), str(tmp_path / "ckpt"))
    kept = tmp_path / "ckpt" / "tokenizer"
    assert sorted(p.name for p in kept.iterdir()) == [
        "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    assert read_config(str(tmp_path / "ckpt")).data.tokenizer == str(kept)
    tokenizer = open_tokenizer(str(kept))
    hf_tok = AutoTokenizer.from_pretrained(src)
    assert tokenizer.bos_id == hf_tok.bos_token_id == 2
    assert tokenizer.eos_ids == (1, stop)
    # transformers, reading the same folder: BOS first, stops at the second EOS id.
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    want = hf_greedy(model, hf_tok(PROMPT).input_ids, 8)
    assert want[-1] == stop and len(want) == 4
    got = jaxmoe_decode(tmp_path / "ckpt", 8)
    assert got["tokens"] == [want] and got["ended"]
    assert got["texts"][0] == hf_tok.decode(want[:-1], skip_special_tokens=True)
    # An override still wins (and is copied in); training from the checkpoint inherits it.
    from pydoc_data.topics import topics

    named = tmp_path / "x.model"
    named.write_bytes(train_sentencepiece(iter(list(topics.values())[:60]), 400))
    convert_hf(str(src), str(tmp_path / "other"), overrides=[f"--config.data.tokenizer={named}"])
    own = tmp_path / "other" / "tokenizer" / "tokenizer.model"
    assert read_config(str(tmp_path / "other")).data.tokenizer == str(own)
    assert own.read_bytes() == named.read_bytes()
    train = inherit_tokenizer(tiny_config(f"train.init_from={tmp_path / 'ckpt'}"))
    assert train.data.tokenizer == str(kept)


def test_eval_generate_stops_at_the_second_eos_id(hf_llama_with_tokenizer, tmp_path):
    """`eval --task generate` stops where transformers does: at the second EOS id of
    generation_config.json, the 4th token (beam search: test_beam_search.py)."""
    pytest.importorskip("rouge_score")
    pytest.importorskip("sacrebleu")
    from jaxmoe.inference.generate_eval import generate_eval

    src, stop = hf_llama_with_tokenizer
    convert_hf(str(src), str(tmp_path / "ckpt"))
    hf_tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    want = hf_greedy(model, hf_tok(PROMPT).input_ids, 8)
    assert want[-1] == stop and len(want) == 4
    text = hf_tok.decode(want[:-1], skip_special_tokens=True)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"inputs": PROMPT, "targets": text}) + "\n")
    out = tmp_path / "predictions.jsonl"
    result = generate_eval(
        str(tmp_path / "ckpt"), f"jsonl:{data}", max_new_tokens=8, output=str(out),
        overrides=MESH,
    )  # fmt: skip
    assert result["new_tokens"] == 4 and result["exact_match"] == 100.0
    assert json.loads(out.read_text())["prediction"] == text


def test_export_of_a_converted_model_carries_the_tokenizer(hf_llama_with_tokenizer, tmp_path):
    src, stop = hf_llama_with_tokenizer
    convert_hf(str(src), str(tmp_path / "ckpt"))
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok(PROMPT).input_ids == AutoTokenizer.from_pretrained(src)(PROMPT).input_ids
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    for values in (config, generation):
        assert values["bos_token_id"] == hf_tok.bos_token_id == 2
        assert values["eos_token_id"] == [hf_tok.eos_token_id, stop]
        assert values["pad_token_id"] == hf_tok.pad_token_id == 0


@pytest.mark.parametrize(
    "overrides",
    [
        ("model.moe.num_experts=0",),
        ("model.moe.num_experts=4", "model.moe.gating=adaptive", "model.moe.threshold=0.3"),
    ],
    ids=["llama", "adaptive_moe"],
)
def test_exported_jaxmoe_model_generates_as_jaxmoe_decode(tmp_path, data_cache, overrides):
    """A model trained with jaxmoe's own SentencePiece tokenizer (EOS 1, pad 0, no BOS),
    exported: AutoTokenizer + AutoModelForCausalLM give `jaxmoe decode`'s greedy tokens."""
    config = tiny_config("model.vocab_size=512", f"data.cache_dir={data_cache}", *overrides)
    sp = load_tokenizer(config.data)
    config = with_overrides(config, [f"data.tokenizer={sp.path}"])
    params = unit_scale_params(config.model, seed=5)
    save_params(str(tmp_path / "ckpt"), params, config)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf_config["eos_token_id"], hf_config["bos_token_id"], hf_config["pad_token_id"]) == (
        hf_tok.eos_token_id, hf_tok.bos_token_id, hf_tok.pad_token_id,
    ) == (sp.eos_id, None, sp.pad_id) == (1, None, 0)  # fmt: skip
    assert model.generation_config.eos_token_id == 1
    ids = hf_tok(PROMPT).input_ids
    assert ids == sp.encode(PROMPT)  # no BOS: jaxmoe's tokenizer has none
    want = hf_greedy(model, ids, 12)
    got = jaxmoe_decode(tmp_path / "ckpt", 12)
    assert got["tokens"] == [want]
    assert got["ended"] == (want[-1] == sp.eos_id)


def test_sentencepiece_model_with_hf_files_beside_it(tmp_path):
    """A converted Llama 2 style `tokenizer.model` (BOS 1, EOS 2): tokenizer_config.json's
    add_bos_token and generation_config.json's EOS list apply, as in transformers."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["the quick brown fox jumps over the lazy dog"] * 50),
        model_writer=model, vocab_size=30, minloglevel=2,
    )  # fmt: skip
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    plain = Tokenizer(str(tmp_path / "tokenizer.model"))
    assert (plain.bos_id, plain.eos_ids) == (None, (2,))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    with_files = Tokenizer(str(tmp_path / "tokenizer.model"))
    assert (with_files.bos_id, with_files.eos_ids) == (1, (2, 7))
    assert with_files.sha256 != plain.sha256  # a different id stream: a different cache key
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "two"}))
    with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id='two'"):
        Tokenizer(str(tmp_path / "tokenizer.model"))


def _stored_config(checkpoint) -> tuple:
    """(path, contents) of a converted checkpoint's config file, as written."""
    path = checkpoint / "config" / "config.json"
    return path, json.loads(path.read_text())


def _set_stored_tokenizer(checkpoint, value: str) -> None:
    path, stored = _stored_config(checkpoint)
    stored["data"]["tokenizer"] = value
    path.write_text(json.dumps(stored))


def test_moved_checkpoint_keeps_its_tokenizer(hf_llama_with_tokenizer, tmp_path):
    """The copied tokenizer is stored relative to the checkpoint: moved elsewhere (the old
    place gone), decode and eval --task generate still stop where transformers does."""
    pytest.importorskip("rouge_score")
    pytest.importorskip("sacrebleu")
    from jaxmoe.inference.generate_eval import generate_eval

    src, stop = hf_llama_with_tokenizer
    convert_hf(str(src), str(tmp_path / "a" / "ckpt"))
    assert _stored_config(tmp_path / "a" / "ckpt")[1]["data"]["tokenizer"] == "tokenizer"
    moved = tmp_path / "b" / "moved"
    moved.parent.mkdir()
    shutil.move(tmp_path / "a" / "ckpt", moved)
    shutil.rmtree(tmp_path / "a")
    assert read_config(str(moved)).data.tokenizer == str(moved / "tokenizer")
    hf_tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    want = hf_greedy(model, hf_tok(PROMPT).input_ids, 8)
    assert want[-1] == stop and len(want) == 4  # the second EOS id ends it
    got = jaxmoe_decode(moved, 8)
    assert got["tokens"] == [want] and got["ended"]
    data = tmp_path / "data.jsonl"
    text = hf_tok.decode(want[:-1], skip_special_tokens=True)
    data.write_text(json.dumps({"inputs": PROMPT, "targets": text}) + "\n")
    result = generate_eval(str(moved), f"jsonl:{data}", max_new_tokens=8, overrides=MESH)
    assert result["new_tokens"] == 4 and result["exact_match"] == 100.0
    # Training from the moved checkpoint inherits the tokenizer where it now is.
    train = inherit_tokenizer(tiny_config(f"train.init_from={moved}"))
    assert train.data.tokenizer == str(moved / "tokenizer")


def test_checkpoint_config_cannot_point_outside_it(hf_llama_with_tokenizer, tmp_path):
    """A checkpoint's config is untrusted: a relative data.tokenizer with `..`, a URL, an
    absolute path outside it or a symlink out of it is refused in one line; the user's
    --config.data.tokenizer still wins."""
    src, _ = hf_llama_with_tokenizer
    ckpt = tmp_path / "ckpt"
    convert_hf(str(src), str(ckpt))
    outside = tmp_path / "outside"
    shutil.copytree(ckpt / "tokenizer", outside)
    config_file = str(ckpt / "config" / "config.json")
    for value, reason in [
        ("../outside", "has a '..' component"),
        ("tokenizer/../../outside", "has a '..' component"),
        ("file:tokenizer", "is absolute or a URL"),
        (str(outside), "lies outside the checkpoint"),
    ]:
        _set_stored_tokenizer(ckpt, value)
        with pytest.raises(CheckpointError) as error:
            read_config(str(ckpt))
        message = str(error.value)
        assert config_file in message and reason in message and "\n" not in message
    # The user's override is used, and the stored value is not looked at.
    assert jaxmoe_decode_with(ckpt, [f"--config.data.tokenizer={ckpt / 'tokenizer'}"])
    # A symlink out of the checkpoint is refused before anything in it is read.
    _set_stored_tokenizer(ckpt, "evil")
    (ckpt / "evil").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"'evil' is a symlink to .*outside"):
        read_config(str(ckpt))


def jaxmoe_decode_with(checkpoint, overrides) -> list:
    return decode_main(
        str(checkpoint), prompt=PROMPT, max_new_tokens=2, overrides=[*MESH, *overrides],
        print_fn=lambda line: None,
    )["tokens"]  # fmt: skip


def test_old_absolute_path_and_derived_checkpoints(hf_llama_with_tokenizer, tmp_path, caplog):
    """A checkpoint converted before paths were relative stores DST/tokenizer absolute:
    moved, it falls back to its own copy (with a warning). `convert gqa` of a converted
    checkpoint copies its tokenizer folder along, stored relative again."""
    src, _ = hf_llama_with_tokenizer
    convert_hf(str(src), str(tmp_path / "old"))
    _set_stored_tokenizer(tmp_path / "old", str(tmp_path / "old" / "tokenizer"))
    assert read_config(str(tmp_path / "old")).data.tokenizer == str(tmp_path / "old/tokenizer")
    shutil.move(tmp_path / "old", tmp_path / "moved")
    with caplog.at_level(logging.WARNING):
        config = read_config(str(tmp_path / "moved"))
    assert config.data.tokenizer == str(tmp_path / "moved" / "tokenizer")
    assert "does not exist" in caplog.text
    convert_gqa(str(tmp_path / "moved"), str(tmp_path / "gqa"), num_kv_heads=1)
    assert _stored_config(tmp_path / "gqa")[1]["data"]["tokenizer"] == "tokenizer"
    assert sorted(p.name for p in (tmp_path / "gqa" / "tokenizer").iterdir()) == sorted(
        p.name for p in (tmp_path / "moved" / "tokenizer").iterdir()
    )
    assert open_tokenizer(read_config(str(tmp_path / "gqa")).data.tokenizer).eos_ids[1] > 1
