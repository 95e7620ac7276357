"""The `data` config section: every key's type, default and one-line doc, and the checks of
their values, run when the section is made.

The curriculum option lists live here, not in curriculum.py: that module imports the whole
pipeline (and through it the checkpoint reader), which the config schema must not.
"""

from dataclasses import dataclass
from typing import Protocol

from jaxmoe.fields import Options, check_choices, need, option

CURRICULUM_POLICIES = ("none", "paper", "magnitude")  # data.curriculum (curriculum.py)
# data.curriculum_source (training/curriculum_hooks.py): where complexities come from.
CURRICULUM_SOURCES = ("previous_epoch", "scoring_pass")
# data.curriculum_reference (curriculum.py): the paper policy's reference example.
CURRICULUM_REFERENCES = ("count", "mean")
# data.format (formats.py): what one record of a jsonl / parquet source is.
FORMATS = ("text", "prompt_completion", "chat", "seq2seq", "preference")
# data.packing (document_packing.py): concat = one token stream cut into windows (documents
# see each other); documents = whole examples per window with segment ids; auto = concat for
# text, documents for the fine-tuning formats.
PACKINGS = ("auto", "concat", "documents")
# data.truncation: an example longer than its window (formats.py).
TRUNCATIONS = ("left", "drop")


# The keys that say how a record becomes an example (they travel with a fine-tuned model).
FORMAT_KEYS = ("format", "text_key", "prompt_key", "completion_key", "messages_key",
               "inputs_key", "targets_key", "chosen_key", "rejected_key", "chat_template",
               "truncation", "targets_len", "packing")  # fmt: skip


class TrainSection(Protocol):
    """What the data reads of the `train` section (training/options.py TrainOptions, a floor
    above): the window, the global batch and the seed of example orders and masks."""

    @property
    def seq_len(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def seed(self) -> int: ...


def span_corruption(arch: str, format: str) -> bool:
    """Whether examples are T5's span corruption: an encoder-decoder model (`model.arch`)
    reading plain text. What the data needs to know of the model."""
    return arch == "encoder_decoder" and format == "text"


def packs_documents(packing: str, format: str) -> bool:
    """Whether examples are packed whole, with segment ids (data.packing resolved)."""
    return packing == "documents" or (packing == "auto" and format != "text")


@dataclass(frozen=True)
class DataOptions(Options):
    """data: where the text comes from, its tokenizer, and how it is batched and ordered."""

    source: str = option("embedded", "embedded | text:GLOB | jsonl:GLOB | parquet:GLOB | tfds:NAME")
    mixture: str = option(
        "", 'several sources with weights, "SOURCE=WEIGHT,SOURCE=WEIGHT" ("" = data.source alone)'
    )
    train_split: str = option("train", "tfds split for training")
    eval_split: str = option("validation", "tfds split for evaluation")
    validation_fraction: float = option(
        0.05, "local sources: share of documents held out for evaluation"
    )
    text_key: str = option("text", "tfds feature, jsonl field or parquet column holding the text")
    format: str = option(
        "text",
        "a record is: text (data.text_key) | prompt_completion | chat (messages) | seq2seq "
        "(inputs/targets, encoder-decoder) | preference (prompt/chosen/rejected, "
        "train.objective=dpo)",
        FORMATS,
    )
    prompt_key: str = option("prompt", "prompt_completion: field of the prompt (not scored)")
    completion_key: str = option(
        "completion", "prompt_completion: field of the completion (scored, then EOS)"
    )
    messages_key: str = option(
        "messages", "chat: field of the [{role, content}] list (assistant turns scored)"
    )
    chosen_key: str = option("chosen", "preference: field of the preferred response")
    rejected_key: str = option("rejected", "preference: field of the dispreferred response")
    inputs_key: str = option("inputs", "seq2seq: field the encoder reads")
    targets_key: str = option("targets", "seq2seq: field the decoder predicts (then EOS)")
    chat_template: str = option(
        "", 'chat: "" = the tokenizer\'s own, "chatml" = the built-in ChatML, or a .jinja file'
    )
    truncation: str = option(
        "left",
        "an example longer than train.seq_len: left = its oldest tokens (prompt) cut, "
        "drop = left out (both counted)",
        TRUNCATIONS,
    )
    targets_len: int = option(0, "seq2seq: decoder tokens per row (0 = train.seq_len)")
    packing: str = option(
        "auto",
        "concat = one token stream in windows (documents see each other) | documents = whole "
        "examples per window, masked apart | auto = concat for text, else documents",
        PACKINGS,
    )
    vocab_size: int = option(1024, "SentencePiece vocabulary when training one")
    tokenizer: str = option(
        "", 'SentencePiece .model, HF tokenizer.json or its folder ("" = train one)'
    )
    eos_token: str = option(
        "", 'EOS of a tokenizer.json without tokenizer_config.json ("" = its </s>, ...)'
    )
    cache_dir: str = option("", 'tokenizer / token cache ("" = ~/.cache/jaxmoe)')
    prepare_timeout_s: int = option(3600, "other processes wait this long for process 0 to prepare")
    data_dir: str = option("", 'TFDS data_dir ("" = under cache_dir)')
    streaming: bool = option(
        False, "train split tokenized as read, no token cache (any objective, mixture, curriculum)"
    )
    shards: int = option(
        0, "train split cached in this many document shards, each tokenized by its readers"
    )
    prefetch: int = option(
        2, "batches built ahead on a background thread (0 = on the training thread)"
    )
    workers: int = option(
        0, "grain worker processes building batches, data.prefetch ahead each (0 = in-process)"
    )
    shuffle: bool = option(True, "shuffle examples each epoch (by train.seed and epoch)")
    curriculum: str = option("none", "order of training examples", CURRICULUM_POLICIES)
    curriculum_source: str = option("previous_epoch", "curriculum routing from", CURRICULUM_SOURCES)
    curriculum_reference: str = option(
        "count",
        "paper: reference = fewest top-2 tokens (count, the paper) | smallest mean fraction",
        CURRICULUM_REFERENCES,
    )
    noise_density: float = option(
        0.15, "encoder_decoder span corruption: share of tokens masked out"
    )
    mean_noise_span: float = option(3.0, "encoder_decoder span corruption: mean masked span length")

    @property
    def packed_documents(self) -> bool:
        return packs_documents(self.packing, self.format)

    def __post_init__(self) -> None:
        check_choices(self, "data.")
        need(self.vocab_size >= 260, f"data.vocab_size={self.vocab_size} < 260 (byte fallback)")
        need(self.prefetch >= 0, f"data.prefetch={self.prefetch} must be >= 0 (0 = off)")
        need(self.shards >= 0, f"data.shards={self.shards} must be >= 0 (0 = one stream)")
        need(self.workers >= 0, f"data.workers={self.workers} must be >= 0 (0 = in-process)")
        for culprit, unsupported in (
            (f"data.curriculum={self.curriculum!r}", self.curriculum != "none"),
            ("data.streaming=true", self.streaming),
            (f"data.mixture={self.mixture!r}", bool(self.mixture)),
            (f"data.shards={self.shards}", self.shards > 0),
        ):
            need(
                not (self.workers and unsupported),
                f"data.workers={self.workers} builds cached single-source batches only, "
                f"not with {culprit} (set data.workers=0)",
            )
        need(self.targets_len >= 0, f"data.targets_len={self.targets_len} must be >= 0")
        if self.format != "text":
            # Which sources hold records is checked where they are opened (sources.py): a
            # checkpoint's stored config names the data it was trained on, not this run's.
            need(
                self.packing != "concat",
                f"data.format={self.format!r} packs whole examples (data.packing=documents), "
                f"not data.packing=concat",
            )
            for culprit, unsupported in (
                (f"data.shards={self.shards}", self.shards > 0),
                (f"data.curriculum={self.curriculum!r}", self.curriculum != "none"),
                (f"data.mixture={self.mixture!r}", bool(self.mixture)),
            ):
                need(
                    not unsupported,
                    f"data.format={self.format!r} is not supported with {culprit} (unset it)",
                )
        if self.packed_documents:
            for culprit, unsupported in (
                (f"data.shards={self.shards}", self.shards > 0),
                (f"data.workers={self.workers}", self.workers > 0),
            ):
                need(
                    not unsupported,
                    f"data.packing=documents (data.format={self.format!r}) is not supported "
                    f"with {culprit} (unset it)",
                )
        need(
            self.prepare_timeout_s > 0,
            f"data.prepare_timeout_s={self.prepare_timeout_s} must be positive",
        )
