"""Fine-tuning data formats (`data.format`): what one jsonl line or parquet row holds, and
how it becomes token ids and per-token loss weights.

- `text`: field `text_key`; [BOS] text EOS; every token scored.
- `prompt_completion`: fields `prompt_key`, `completion_key`; [BOS] prompt completion EOS;
  the completion and its EOS scored.
- `chat`: field `messages_key`, a list of {role, content}; the chat template's rendering
  (chat_template.py); the assistant turns scored.
- `seq2seq` (encoder-decoder): fields `inputs_key`, `targets_key`; the encoder reads inputs
  EOS, the decoder predicts targets EOS; every target token scored.
- `preference` (DPO, train.objective=dpo): fields `prompt_key`, `chosen_key`,
  `rejected_key`; two examples per record, [BOS] prompt chosen EOS and [BOS] prompt rejected
  EOS, each scored on its response (as prompt_completion), packed into one window as two
  consecutive documents (document_packing.py) so a pair is never split.

Router replay (model.moe.replay): a decoder-only record may carry `routing` (the preference
format: `chosen_routing` and `rejected_routing`), its recorded experts per position and MoE
layer (routing_record.py); the encoder then gives each example a third array of them.

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
from jaxmoe.data.routing_record import dense_routing
from jaxmoe.data.tokenizer import with_bos

CANONICAL = {
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "chat": ("messages",),
    "seq2seq": ("inputs", "targets"),
    "preference": ("prompt", "chosen", "rejected"),
}
# Recorded routing a record may carry (model.moe.replay), by format.
ROUTING_FIELDS = {"preference": ("chosen_routing", "rejected_routing")}


@dataclasses.dataclass(frozen=True)
class RecordFields:
    """Which fields of a record a format reads: `keys` in the record, in CANONICAL order."""

    format: str
    keys: tuple[str, ...]

    @classmethod
    def of(cls, data) -> "RecordFields":
        """The fields of the `data` config section (DataOptions)."""
        keys = {
            "text": (data.text_key or "text",),
            "prompt_completion": (data.prompt_key, data.completion_key),
            "chat": (data.messages_key,),
            "seq2seq": (data.inputs_key, data.targets_key),
            "preference": (data.prompt_key, data.chosen_key, data.rejected_key),
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
        if self.format != "seq2seq":  # recorded routing travels with the example
            for name in ROUTING_FIELDS.get(self.format, ("routing",)):
                if name in record:
                    values[name] = record[name]
        return json.dumps(values, ensure_ascii=False, sort_keys=True)


def _key_name(fields: RecordFields, key: str) -> str:
    """The config key that names field `key` of `fields`' format."""
    names = {
        "prompt_completion": ("prompt_key", "completion_key"),
        "chat": ("messages_key",),
        "seq2seq": ("inputs_key", "targets_key"),
        "preference": ("prompt_key", "chosen_key", "rejected_key"),
    }[fields.format]
    return names[fields.keys.index(key)]


class ExampleEncoder:
    """Documents of one format -> token ids and loss weights (`encode`), for one tokenizer.

    Decoder-only formats give (ids int32 [n], weights uint8 [n]); seq2seq gives (encoder
    ids [n], target ids [m]), both EOS-terminated. `identity` is what the cached ids depend
    on besides the tokenizer (the format, and the chat template's text).
    """

    def __init__(self, data, tokenizer, culprit: str = "data.tokenizer", routing=None):
        """`routing` (routing_record.RoutingShape, model.moe.replay): every decoder-only
        example also gives its recorded experts, int16 [n, M * K]."""
        self.format, self.tokenizer = data.format, tokenizer
        self.template = None
        self.identity = data.format
        self.routing = routing
        if data.format == "chat":
            source = template_source(data.chat_template, tokenizer, culprit)
            self.template = ChatTemplate(source, tokenizer)
            self.identity = f"chat|{source}"
        if routing is not None:
            self.identity += f"|routing {routing}"

    def encode_all(self, document: str) -> list[tuple]:
        """Every example of one document: one, none (nothing to learn from), or for the
        preference format the chosen and the rejected example (both or neither)."""
        if self.format != "preference":
            example = self.encode(document)
            return [] if example is None else [example]
        record = json.loads(document)
        pair = []
        for side in ("chosen", "rejected"):
            one = {"prompt": record["prompt"], "completion": record[side]}
            if f"{side}_routing" in record:
                one["routing"] = record[f"{side}_routing"]
            pair.append(self._prompt_completion(one, f"the {side} response"))
        return pair

    def encode(self, document: str) -> tuple[np.ndarray, np.ndarray] | None:
        """One document's arrays; None when it has no tokens (skipped)."""
        tok = self.tokenizer
        if self.format == "preference":
            raise ValueError("preference records hold two examples: ExampleEncoder.encode_all")
        if self.format in ("prompt_completion", "chat"):
            record = json.loads(document)
            if self.format == "prompt_completion":
                return self._prompt_completion(record, "the example")
            return self._with_routing(*self.template.encode(record["messages"]), record, "")
        if self.format == "text":
            ids = tok.encode(document)
            if not ids:
                return None
            ids = np.asarray([*with_bos(tok, ids), tok.eos_id], np.int32)
            return ids, np.ones(len(ids), np.uint8)
        record = json.loads(document)
        inputs = np.asarray([*tok.encode(record["inputs"]), tok.eos_id], np.int32)
        targets = np.asarray([*tok.encode(record["targets"]), tok.eos_id], np.int32)
        return inputs, targets

    def _prompt_completion(self, record: dict, what: str) -> tuple:
        """[BOS] prompt completion EOS, the completion and its EOS scored."""
        tok = self.tokenizer
        prompt = with_bos(tok, tok.encode(record["prompt"]))
        completion = [*tok.encode(record["completion"]), tok.eos_id]
        ids = np.asarray(prompt + completion, np.int32)
        weights = np.concatenate(
            [np.zeros(len(prompt), np.uint8), np.ones(len(completion), np.uint8)]
        )
        return self._with_routing(ids, weights, record, what)

    def _with_routing(self, ids, weights, record: dict, what: str) -> tuple:
        """(ids, weights), plus the recorded experts [n, M * K] under model.moe.replay."""
        if self.routing is None:
            return ids, weights
        where = f"{what or 'the example'} starting {_opening(record)}"
        if "routing" not in record:
            raise ValueError(
                f"{where}: no recorded routing (model.moe.replay=true replays it for every "
                f"example: a `routing` field per record)"
            )
        return ids, weights, dense_routing(record["routing"], self.routing, len(ids), where)


def _opening(record: dict) -> str:
    """The first words of a record, to name it in an error."""
    text = record.get("prompt") or json.dumps(record.get("messages", ""))[:60]
    return repr(str(text)[:40])


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
