"""jaxmoe's SentencePiece tokenizer written as a Hugging Face `tokenizer.json`: transformers
must tokenize and decode every string exactly as the sentencepiece library does, and models
with other settings (T5's dummy prefix) must be refused in one line."""

import io

import pytest
import sentencepiece as spm

from jaxmoe.conversions.hf.tokenizer import tokenizer_json, write_hf_tokenizer
from jaxmoe.data.sources import load_tokenizer
from jaxmoe.data.tokenizer import Tokenizer
from tests.helpers import tiny_config

TEXTS = [
    "Question: How many legs does a spider have?\nAnswer: eight",
    "  two  spaces\tand a tab",
    "digits 12345 3.14",
    "unicode é ü 日本語 🙂 ☃",
    " leading and trailing ",
    "",
]


def test_transformers_tokenizes_as_sentencepiece(data_cache, tmp_path):
    from transformers import AutoTokenizer

    sp = load_tokenizer(tiny_config(f"data.cache_dir={data_cache}").data)
    write_hf_tokenizer(sp.path, tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert hf.encode(text) == sp.encode(text), text
        assert hf.decode(hf.encode(text)) == text
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (sp.eos_id, sp.pad_id, None)


def test_other_sentencepiece_settings_are_refused(tmp_path):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["the quick brown fox jumps over the lazy dog"] * 50),
        model_writer=model,
        vocab_size=30,
        add_dummy_prefix=True,  # T5's setting: a space is invented before the text
        minloglevel=2,
    )
    path = tmp_path / "t5_like.model"
    path.write_bytes(model.getvalue())
    Tokenizer(str(path))  # a valid model for jaxmoe itself
    with pytest.raises(ValueError, match=r"t5_like\.model: has normalization 'nmt_nfkc', a dummy"):
        tokenizer_json(str(path))
