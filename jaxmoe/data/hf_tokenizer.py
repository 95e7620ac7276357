"""Hugging Face tokenizers: a `tokenizer.json` (Llama 3, Qwen, Mistral, ...) read through
the `tokenizers` library, with the same interface as the SentencePiece `Tokenizer`.

Special tokens come from the tokenizer's own files, the way `transformers` reads them:
`tokenizer_config.json` (then `special_tokens_map.json`) next to `tokenizer.json` names the
BOS, EOS and pad tokens and may say `add_bos_token`. Without that key, the tokenizer's own
post-processor decides: the single token it puts before a text is the BOS every document and
prompt starts with (Llama 3's `<|begin_of_text|>`), none for Qwen. EOS likewise: the
config's, else the single token the post-processor appends, else the first of
`CONVENTIONAL_EOS` the vocabulary holds (a bare tokenizer.json); `data.eos_token` names it
outright. Text is encoded without
the post-processor (documents are packed as [BOS] text EOS by the caller). Generation stops
at EOS and at the further ids of a `generation_config.json` next to the tokenizer
(`eos_token_id`, one id or a list: Llama 3 Instruct's `<|eot_id|>`...).
"""

import functools
import hashlib
import os
from collections.abc import Sequence

import tokenizers

from jaxmoe.data.tokenizer_files import chat_template, generation_eos_ids, read_json_object
from jaxmoe.storage.received import TOKENIZER_LIMIT, read_file

TOKENIZER_FILE = "tokenizer.json"
_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# EOS names of the common model families (T5/Llama 2, GPT-2/Qwen, Llama 3, Gemma), in the
# order tried when no config names one.
CONVENTIONAL_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")


def tokenizer_file(path: str) -> str:
    """`path` itself, or the tokenizer.json inside the folder `path`."""
    return os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path


def _token_text(value) -> str | None:
    """A special token as written in the config: a string or {"content": ...} (AddedToken)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_configs(folder: str, culprit: str) -> dict:
    """Keys of tokenizer_config.json, filled in from special_tokens_map.json."""
    merged: dict = {}
    for name in reversed(_CONFIG_FILES):  # the first file wins
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        merged.update(read_json_object(path, culprit))
    return merged


def _template(tok: tokenizers.Tokenizer) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after a text (e.g. [BOS], [])."""
    probe = "a"
    bare = tok.encode(probe, add_special_tokens=False).ids
    full = tok.encode(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start], full[start + len(bare) :]
    return [], []


class HFTokenizer:
    """A Hugging Face `tokenizer.json`. encode(str) -> list[int]; decode(list[int]) -> str."""

    def __init__(self, path: str, eos_token: str = ""):
        """`eos_token` (data.eos_token): the EOS token, over what the files say ("" = theirs)."""
        file = tokenizer_file(path)
        if not os.path.exists(file):
            where = f"has no {TOKENIZER_FILE}" if os.path.isdir(path) else "does not exist"
            raise ValueError(f"data.tokenizer={path!r} {where}")
        try:  # a received file: a regular one of a tokenizer's size (received.py)
            raw = read_file(file, TOKENIZER_FILE, TOKENIZER_LIMIT)
        except (OSError, ValueError) as error:
            problem = str(error).removeprefix(f"{file}: ")
            raise ValueError(f"data.tokenizer={path!r}: {file}: {problem}") from None
        try:
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"data.tokenizer={path!r} is not a Hugging Face tokenizer.json ({first})"
            ) from None
        self.path = os.path.abspath(file)
        config = _read_configs(os.path.dirname(self.path), path)
        prefix, suffix = _template(self._tok)
        self.eos_id = self._eos(config, suffix, eos_token, path)
        if "add_bos_token" in config:
            wanted = bool(config["add_bos_token"])
            self.bos_id = self._special(config, "bos_token", path) if wanted else None
            if wanted and self.bos_id is None:
                raise ValueError(f"data.tokenizer={path!r} says add_bos_token but has no bos_token")
        else:
            self.bos_id = prefix[0] if len(prefix) == 1 else None
        # The special tokens' texts a chat template reads (transformers' special_tokens_map).
        self.special_tokens = {
            key: text
            for key, value in config.items()
            if key.endswith("_token") and (text := _token_text(value)) is not None
        }
        self.chat_template = chat_template(os.path.dirname(self.path), config, path)
        self.pad_token_id = self._special(config, "pad_token", path)  # None: it has none
        self.pad_id = self.pad_token_id or 0
        extra = generation_eos_ids(os.path.dirname(self.path), path)
        self.eos_ids = tuple(dict.fromkeys([self.eos_id, *extra]))  # EOS first, no repeats
        # The id stream depends on the file and on the special ids resolved from the configs.
        specials = f"|bos={self.bos_id}|eos={self.eos_id}|pad={self.pad_id}".encode()
        self.sha256 = hashlib.sha256(raw + specials).hexdigest()

    def _eos(self, config: dict, suffix: list[int], eos_token: str, culprit: str) -> int:
        if eos_token:
            token_id = self._tok.token_to_id(eos_token)
            if token_id is None:
                raise ValueError(
                    f"data.eos_token={eos_token!r} is not a token of data.tokenizer={culprit!r}"
                )
            return token_id
        token_id = self._special(config, "eos_token", culprit)
        if token_id is None and len(suffix) == 1:
            token_id = suffix[0]
        for name in CONVENTIONAL_EOS if token_id is None else ():
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                break
        if token_id is None:
            raise ValueError(
                f"data.tokenizer={culprit!r} defines no EOS token (no eos_token in "
                f"{_CONFIG_FILES[0]}, no single token appended by its post-processor, none of "
                f"{' '.join(CONVENTIONAL_EOS)} in its vocabulary): name it with "
                f"--config.data.eos_token=TOKEN"
            )
        return token_id

    def _special(self, config: dict, key: str, culprit: str) -> int | None:
        text = _token_text(config.get(key))
        if text is None:
            return None
        token_id = self._tok.token_to_id(text)
        if token_id is None:
            raise ValueError(f"data.tokenizer={culprit!r}: {key} {text!r} is not in its vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Ids run over [0, vocab_size): the largest id + 1, the rows an embedding table needs
        to hold every id (a tokenizer.json may leave gaps: counting its tokens is not it)."""
        return self._largest_id + 1

    @functools.cached_property
    def _largest_id(self) -> int:
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)

    def token_of_id(self, token_id: int) -> str | None:
        """The token with id `token_id`, or None."""
        return self._tok.id_to_token(token_id)

    def token_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary, or None if it has no such token."""
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, the [start, end) characters of `text` each id stands for), special tokens
        written in the text included, none added (what apply_chat_template encodes)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encodes many texts at once, on the library's own threads."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer(path={self.path!r}, vocab_size={self.vocab_size})"
