"""jaxmoe's SentencePiece tokenizer as a Hugging Face fast tokenizer (`tokenizer.json`).

jaxmoe trains unigram models with no normalisation, no dummy prefix and byte fallback
(data/tokenizer.py). Such a model is exactly a `tokenizers` Unigram model over the same
pieces and scores, applied to the text with spaces written as U+2581 and no pre-splitting:
both pick the highest-scoring segmentation and spell unknown characters as UTF-8 bytes.
Models with other settings (T5's dummy prefix and NFKC rules, BPE) are refused.

Written by hand as JSON (the format `tokenizers` reads), so exporting needs no extra
package. One difference remains: the special pieces' text (`</s>`) typed inside a string
is one special token in Hugging Face and plain characters in SentencePiece.
"""

import json
from pathlib import Path

from sentencepiece import sentencepiece_model_pb2

from jaxmoe.storage.received import TOKENIZER_LIMIT, read_file

SPACE = "\u2581"  # SentencePiece's visible space


def _load(sp_model_path: str):
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(read_file(sp_model_path, "tokenizer model", TOKENIZER_LIMIT))
    norm, trainer = proto.normalizer_spec, proto.trainer_spec
    problems = []
    if trainer.model_type != sentencepiece_model_pb2.TrainerSpec.UNIGRAM:
        problems.append("not a unigram model")
    if norm.precompiled_charsmap or norm.name not in ("identity", ""):
        problems.append(f"normalization {norm.name!r}")
    if norm.add_dummy_prefix:
        problems.append("a dummy prefix")
    if norm.remove_extra_whitespaces:
        problems.append("whitespace removal")
    if not norm.escape_whitespaces:
        problems.append("unescaped whitespace")
    if problems:
        raise ValueError(
            f"tokenizer {sp_model_path}: has {', '.join(problems)}; only jaxmoe's own "
            f"SentencePiece models (identity, no dummy prefix) are written for Hugging Face"
        )
    return proto


def _append_eos(eos: str, eos_id: int) -> dict:
    """A post-processor that ends every encoded text with EOS (what T5 encoders read)."""
    a, b = ({"Sequence": {"id": x, "type_id": 0}} for x in "AB")
    end = {"SpecialToken": {"id": eos, "type_id": 0}}
    return {
        "type": "TemplateProcessing",
        "single": [a, end],
        "pair": [a, end, b, end],
        "special_tokens": {eos: {"id": eos, "ids": [eos_id], "tokens": [eos]}},
    }


def tokenizer_json(sp_model_path: str, append_eos: bool = False) -> dict:
    """The `tokenizer.json` of a jaxmoe SentencePiece model; `append_eos` for an
    encoder-decoder, whose inputs end with EOS as in jaxmoe's training and evaluation."""
    proto = _load(sp_model_path)
    kinds = sentencepiece_model_pb2.ModelProto.SentencePiece
    vocab, added, unk_id = [], [], None
    for i, piece in enumerate(proto.pieces):
        vocab.append([piece.piece, float(piece.score)])
        if piece.type == kinds.UNKNOWN:
            unk_id = i
        if piece.type in (kinds.CONTROL, kinds.UNKNOWN):
            added.append(
                {
                    "id": i,
                    "content": piece.piece,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": True,
                }
            )
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
        "pre_tokenizer": None,
        "post_processor": _append_eos(
            proto.pieces[proto.trainer_spec.eos_id].piece, proto.trainer_spec.eos_id
        )
        if append_eos
        else None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        },
        "model": {
            "type": "Unigram",
            "unk_id": unk_id,
            "vocab": vocab,
            "byte_fallback": bool(proto.trainer_spec.byte_fallback),
        },
    }


def write_hf_tokenizer(sp_model_path: str, dst: Path, append_eos: bool = False) -> None:
    """Writes `tokenizer.json` + `tokenizer_config.json` into the model directory `dst`."""
    tokenizer = tokenizer_json(sp_model_path, append_eos)
    trainer = _load(sp_model_path).trainer_spec
    vocab = tokenizer["model"]["vocab"]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for role in ("pad", "eos", "unk", "bos"):
        index = getattr(trainer, f"{role}_id")
        if 0 <= index < len(vocab):
            config[f"{role}_token"] = vocab[index][0]
    (dst / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False) + "\n")
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
