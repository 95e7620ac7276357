"""Fine-tuning data formats (`data.format`): what one jsonl line or parquet row holds, and
how it becomes token ids and per-token loss weights.

- `text`: field `text_key`; [BOS] text EOS; every token scored.
- `prompt_completion`: fields `prompt_key`, `completion_key`; [BOS] prompt completion EOS;
  the completion and its EOS scored.
- `chat`: field `messages_key`, a list of {role, content}; the chat template's rendering
  (chat_template.py); the assistant turns scored.
- `seq2seq` (encoder-decoder): fields `inputs_key`, `targets_key`; the encoder reads inputs
  EOS, the decoder predicts targets EOS; every target token scored.

A decoder-only example of n ids x with weights w gives n - 1 predictions: inputs x[:-1],
targets x[1:], weights w[1:] (the scoring convention of `jaxmoe eval` and Hugging Face).
The prompt and the completion are tokenized apart, so the boundary between them is exact.

A record is read once, when the source is prepared, into a *document*: the JSON text of its
fields under their canonical names (`prompt`, `completion`, `messages`, `inputs`,
`targets`). Documents are what the sources split, hash, cache and stream like texts, so every
source path (the prepared cache, streaming, mixtures of documents) carries any format.

An example longer than its window (`train.seq_len` predictions, `data.targets_len` for a
seq2seq decoder) follows `data.truncation`: `left` cuts its oldest tokens (the prompt's
start, the first turns; a seq2seq example's inputs) as long as its last scored run (the
completion and its EOS, the last assistant turn, all of a seq2seq example's targets) stays
whole, and drops it otherwise; `drop` leaves every long example out. Both are counted in the
line printed when the data is packed.
"""

import dataclasses
import json

import numpy as np

from jaxmoe.data.chat_template import ChatTemplate, check_messages, template_source
from jaxmoe.data.tokenizer import with_bos

CANONICAL = {
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "chat": ("messages",),
    "seq2seq": ("inputs", "targets"),
}


@dataclasses.dataclass(frozen=True)
class RecordFields:
    """Which fields of a record a format reads: `keys` in the record, in CANONICAL order."""

    format: str
    keys: tuple[str, ...]

    @classmethod
    def of(cls, data) -> "RecordFields":
        """The fields of the `data` config section (a DataOptions or its ConfigDict)."""
        keys = {
            "text": (data.text_key or "text",),
            "prompt_completion": (data.prompt_key, data.completion_key),
            "chat": (data.messages_key,),
            "seq2seq": (data.inputs_key, data.targets_key),
        }[data.format]
        return cls(data.format, tuple(keys))

    def describe(self) -> str:
        """What the fingerprint of a prepared source records (the text format: its key)."""
        return self.keys[0] if self.format == "text" else f"{self.format}:{','.join(self.keys)}"

    def read(self, record, where: str) -> str | None:
        """The document of one record (None: nothing to learn from, skipped): its text, or
        the JSON of its fields under their canonical names. Bad records are one-line errors
        naming `where` (file:line) and the field."""
        missing = [k for k in self.keys if not isinstance(record, dict) or k not in record]
        if missing:
            key = "text_key" if self.format == "text" else _key_name(self, missing[0])
            raise ValueError(f"{where}: no field data.{key}={missing[0]!r}")
        if self.format == "text":
            text = record[self.keys[0]]
            if text is not None and not isinstance(text, str):
                raise ValueError(
                    f"{where}: field {self.keys[0]!r} is {type(text).__name__}, not text"
                )
            return text or None
        values = {}
        for name, key in zip(CANONICAL[self.format], self.keys, strict=True):
            value = record[key]
            if self.format == "chat":
                value = check_messages(value, f"{where}: field {key!r}")
            elif not isinstance(value, str):
                raise ValueError(f"{where}: field {key!r} is {type(value).__name__}, not text")
            values[name] = value
        return json.dumps(values, ensure_ascii=False, sort_keys=True)


def _key_name(fields: RecordFields, key: str) -> str:
    """The config key that names field `key` of `fields`' format."""
    names = {
        "prompt_completion": ("prompt_key", "completion_key"),
        "chat": ("messages_key",),
        "seq2seq": ("inputs_key", "targets_key"),
    }[fields.format]
    return names[fields.keys.index(key)]


class ExampleEncoder:
    """Documents of one format -> token ids and loss weights (`encode`), for one tokenizer.

    Decoder-only formats give (ids int32 [n], weights uint8 [n]); seq2seq gives (encoder
    ids [n], target ids [m]), both EOS-terminated. `identity` is what the cached ids depend
    on besides the tokenizer (the format, and the chat template's text).
    """

    def __init__(self, data, tokenizer, culprit: str = "data.tokenizer"):
        self.format, self.tokenizer = data.format, tokenizer
        self.template = None
        self.identity = data.format
        if data.format == "chat":
            source = template_source(data.chat_template, tokenizer, culprit)
            self.template = ChatTemplate(source, tokenizer)
            self.identity = f"chat|{source}"

    def encode(self, document: str) -> tuple[np.ndarray, np.ndarray] | None:
        """One document's arrays; None when it has no tokens (skipped)."""
        tok = self.tokenizer
        if self.format == "text":
            ids = tok.encode(document)
            if not ids:
                return None
            ids = np.asarray([*with_bos(tok, ids), tok.eos_id], np.int32)
            return ids, np.ones(len(ids), np.uint8)
        record = json.loads(document)
        if self.format == "prompt_completion":
            prompt = with_bos(tok, tok.encode(record["prompt"]))
            completion = [*tok.encode(record["completion"]), tok.eos_id]
            ids = np.asarray(prompt + completion, np.int32)
            weights = np.concatenate(
                [np.zeros(len(prompt), np.uint8), np.ones(len(completion), np.uint8)]
            )
            return ids, weights
        if self.format == "chat":
            return self.template.encode(record["messages"])
        inputs = np.asarray([*tok.encode(record["inputs"]), tok.eos_id], np.int32)
        targets = np.asarray([*tok.encode(record["targets"]), tok.eos_id], np.int32)
        return inputs, targets


def fit_decoder_example(
    ids: np.ndarray, weights: np.ndarray, window: int, truncation: str
) -> tuple[np.ndarray, np.ndarray] | None:
    """A decoder-only example made to give at most `window` predictions (n - 1 <= window):
    as it is; cut from the left (`left`) when its last scored run (the completion, the last
    assistant turn) stays whole with the token before it; else None (dropped). An example
    with nothing scored is dropped too."""
    scored = np.flatnonzero(np.asarray(weights[1:], bool)) + 1
    if not scored.size:
        return None
    if len(ids) - 1 <= window:
        return ids, weights
    gaps = np.flatnonzero(np.diff(scored) > 1)
    last_run = int(scored[gaps[-1] + 1] if gaps.size else scored[0])
    start = len(ids) - window - 1
    if truncation != "left" or start >= last_run:
        return None
    return ids[start:], weights[start:]


def fit_seq2seq_example(
    inputs: np.ndarray, targets: np.ndarray, encoder_len: int, decoder_len: int, truncation: str
) -> tuple[np.ndarray, np.ndarray] | None:
    """A seq2seq example made to fit (encoder_len, decoder_len): its inputs cut from the left
    (`left`), or None (dropped); targets too long always drop it (they are what is scored)."""
    if len(targets) > decoder_len:
        return None
    if len(inputs) > encoder_len:
        if truncation != "left":
            return None
        inputs = inputs[-encoder_len:]
    return inputs, targets
