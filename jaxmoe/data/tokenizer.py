"""SentencePiece tokenizer: trained once per (train data, vocab size) and cached, or loaded;
`open_tokenizer` also opens Hugging Face tokenizer.json files (hf_tokenizer.py).

Trained models round-trip exactly, decode(encode(text)) == text for any string: no
normalisation (`identity`), whitespace kept as written, no dummy prefix, and unknown
characters fall back to their UTF-8 bytes. Ids: pad 0, eos 1, unk 2, no bos. A model from
elsewhere (a converted Llama 2's `tokenizer.model`) starts texts with its BOS when the
`tokenizer_config.json` beside it says `add_bos_token`, and generation also stops at the
`eos_token_id`s of a `generation_config.json` there, as transformers does.
"""

import hashlib
import io
import os
from collections.abc import Iterator, Sequence

import numpy as np
import sentencepiece as spm
from etils import epath

from jaxmoe.data.tokenizer_files import chat_template, generation_eos_ids, read_json_object
from jaxmoe.storage.paths import is_remote
from jaxmoe.storage.received import TOKENIZER_LIMIT, read_file
from jaxmoe.storage.temporaries import write_atomically

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
# Changing any training option below must change this, so stale cached models are not used.
_TRAINING_RECIPE = "unigram-identity-bytefallback-v1"
# Fixed, so the trained model does not depend on the machine's core count.
_TRAINING_THREADS = 4
# Enough text to learn a vocabulary of a few thousand pieces; larger splits are sampled.
_TRAINING_CHAR_BUDGET = 50_000_000
# 256 byte pieces + pad, eos, unk: a smaller vocabulary cannot represent every string.
MIN_VOCAB_SIZE = 256 + 3 + 1


class Tokenizer:
    """A SentencePiece model file. encode(str) -> list[int]; decode(list[int]) -> str."""

    def __init__(self, path: str):
        file = epath.Path(path)  # a local path or a remote URI (gs://...)
        if is_remote(path):
            if not file.is_file():
                raise ValueError(f"data.tokenizer={path!r} does not exist")
            model_bytes = file.read_bytes()
        else:  # a received file: a regular one of a tokenizer's size (received.py)
            try:
                model_bytes = read_file(path, "tokenizer model", TOKENIZER_LIMIT)
            except FileNotFoundError:
                raise ValueError(f"data.tokenizer={path!r} does not exist") from None
            except (OSError, ValueError) as error:
                problem = str(error).removeprefix(f"{path}: ")
                raise ValueError(f"data.tokenizer={path!r}: {problem}") from None
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(model_bytes)
        except Exception:  # sentencepiece raises RuntimeError / OSError on bad protos
            raise ValueError(f"data.tokenizer={path!r} is not a SentencePiece model") from None
        if self._sp.eos_id() < 0:
            raise ValueError(f"data.tokenizer={path!r} defines no EOS piece (eos_id < 0)")
        self.path = path if is_remote(path) else os.path.abspath(path)
        self.sha256 = hashlib.sha256(model_bytes).hexdigest()
        self.bos_id, self.eos_ids = None, (self._sp.eos_id(),)
        if not is_remote(path):
            self._read_hf_configs(os.path.dirname(self.path), path)

    def _read_hf_configs(self, folder: str, culprit: str) -> None:
        """BOS, extra stop ids and the chat template from Hugging Face files beside the
        model, if any."""
        config_path = os.path.join(folder, "tokenizer_config.json")
        config = read_json_object(config_path, culprit) if os.path.isfile(config_path) else {}
        self.chat_template = chat_template(folder, config, culprit)
        wants_bos = os.path.isfile(config_path) and self._sp.bos_id() >= 0
        if wants_bos and config.get("add_bos_token", False):
            self.bos_id = self._sp.bos_id()
            # The id stream depends on BOS too: cached streams must not be reused.
            self.sha256 = hashlib.sha256(f"{self.sha256}|bos".encode()).hexdigest()
        extra = generation_eos_ids(folder, culprit)
        self.eos_ids = tuple(dict.fromkeys([self._sp.eos_id(), *extra]))

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def token_of_id(self, token_id: int) -> str | None:
        """The piece with id `token_id`, or None."""
        return self._sp.id_to_piece(token_id) if 0 <= token_id < self.vocab_size else None

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        """The model's pad id, or 0 if it has none (padding always carries weight 0)."""
        return max(self._sp.pad_id(), 0)

    @property
    def pad_token_id(self) -> int | None:
        """The model's own pad id, None if it has none (what a Hugging Face config says)."""
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else None

    def token_id(self, piece: str) -> int | None:
        """The id of a piece of the model, or None if it has no such piece."""
        token_id = self._sp.piece_to_id(piece)
        return token_id if self._sp.id_to_piece(token_id) == piece else None

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, the [start, end) characters of `text` each id stands for)."""
        try:  # "proto" since sentencepiece 0.2.1; "immutable_proto" before (since removed)
            pieces = self._sp.encode(text, out_type="proto").pieces
        except (ValueError, TypeError, RuntimeError):
            pieces = self._sp.encode(text, out_type="immutable_proto").pieces
        # SentencePiece counts UTF-8 bytes: map byte offsets back to characters.
        char_at_byte = np.cumsum([0] + [len(c.encode()) for c in text])
        to_char = {int(b): i for i, b in enumerate(char_at_byte)}
        return [p.id for p in pieces], [(to_char[p.begin], to_char[p.end]) for p in pieces]

    @property
    def special_tokens(self) -> dict[str, str]:
        """The special tokens' texts a chat template reads (bos_token, eos_token, ...)."""
        sp = self._sp
        ids = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "unk_token": sp.unk_id(),
               "pad_token": sp.pad_id()}  # fmt: skip
        return {key: sp.id_to_piece(i) for key, i in ids.items() if i >= 0}

    chat_template = None  # a SentencePiece model holds none (one beside it: _read_hf_configs)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encodes many texts at once, on several threads."""
        return self._sp.encode(texts, out_type=int, num_threads=os.cpu_count() or 1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size})"


def open_tokenizer(path: str, eos_token: str = ""):
    """The tokenizer at `path`: a Hugging Face tokenizer.json (or a folder holding one),
    else a SentencePiece model file (or a folder holding one without a tokenizer.json: a
    checkpoint's `tokenizer/`, T5's `spiece.model`). `eos_token` (data.eos_token) names the
    EOS of a tokenizer.json whose files do not."""
    from jaxmoe.data import hf_tokenizer  # imports `tokenizers` only when asked for

    if os.path.isdir(path) and not os.path.exists(hf_tokenizer.tokenizer_file(path)):
        for name in SENTENCEPIECE_FILES:
            if os.path.isfile(os.path.join(path, name)):
                return Tokenizer(os.path.join(path, name))
    if path.endswith(".json") or os.path.isdir(path):
        return hf_tokenizer.HFTokenizer(path, eos_token=eos_token)
    return Tokenizer(path)


# A folder's SentencePiece model, by the names checkpoints and Hugging Face give it.
SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model")


def with_bos(tokenizer, ids: list[int]) -> list[int]:
    """`ids` preceded by the tokenizer's BOS when it has one (how its documents start)."""
    return ids if tokenizer.bos_id is None else [tokenizer.bos_id, *ids]


def training_lines(documents: Sequence[str], char_budget: int = _TRAINING_CHAR_BUDGET):
    """Yields the non-empty lines of documents, visited in a fixed pseudo-random order until
    `char_budget` characters: deterministic, and an even sample of a split too big to use.
    """
    order = np.random.default_rng(0).permutation(len(documents))
    used = 0
    for index in order:
        for line in documents[int(index)].split("\n"):
            if line:
                yield line
                used += len(line)
        if used >= char_budget:
            return


def train_sentencepiece(lines: Iterator[str], vocab_size: int) -> bytes:
    """Trains a unigram SentencePiece model; returns the serialised model."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"data.vocab_size={vocab_size} must be at least {MIN_VOCAB_SIZE}")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines,
            model_writer=model,
            model_type="unigram",
            vocab_size=vocab_size,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            byte_fallback=True,
            character_coverage=0.9995,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            bos_id=-1,
            input_sentence_size=0,  # use every line given: the sampling is ours, seeded
            max_sentence_length=1 << 16,
            num_threads=_TRAINING_THREADS,
            minloglevel=2,
        )
    except RuntimeError as e:
        # e.g. "Vocabulary size too high (1024). Please set it to a value <= 873."
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else "training failed"
        raise ValueError(f"data.vocab_size={vocab_size}: sentencepiece: {reason}") from None
    return model.getvalue()


def cached_tokenizer(
    train_documents: Sequence[str],
    train_fingerprint: str,
    vocab_size: int,
    cache_dir: str,
    remote=None,
) -> Tokenizer:
    """Loads the tokenizer trained on these documents, training and caching it if needed.

    `remote`: a jaxmoe.storage.mirror.Mirror of CACHE_DIR/tokenizers on remote storage, which is
    asked before training and given the trained file."""
    key = hashlib.sha256(
        f"{_TRAINING_RECIPE}|{train_fingerprint}|{vocab_size}".encode()
    ).hexdigest()[:20]
    name = f"spm_{vocab_size}_{key}.model"
    path = os.path.join(cache_dir, "tokenizers", name)
    if not os.path.exists(path) and not (remote and remote.pull(name)):
        if len(train_documents) == 0:
            raise ValueError("cannot train a tokenizer: the train split has no documents")
        write_atomically(path, train_sentencepiece(training_lines(train_documents), vocab_size))
        if remote:
            remote.push(name)
    return Tokenizer(path)
