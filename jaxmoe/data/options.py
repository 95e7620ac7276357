"""The `data` config section: every key's type, default and one-line doc, and the checks of
their values (jaxmoe/config builds the ConfigDict defaults from these and runs the checks
through `jaxmoe.config.typed`).

The curriculum option lists live here, not in curriculum.py: that module imports the whole
pipeline (and through it the checkpoint reader), which the config schema must not.
"""

from dataclasses import dataclass

from jaxmoe.config.fields import need, option

CURRICULUM_POLICIES = ("none", "paper", "magnitude")  # data.curriculum (curriculum.py)
# data.curriculum_source (training/curriculum_hooks.py): where complexities come from.
CURRICULUM_SOURCES = ("previous_epoch", "scoring_pass")
# data.curriculum_reference (curriculum.py): the paper policy's reference example.
CURRICULUM_REFERENCES = ("count", "mean")


@dataclass(frozen=True)
class DataOptions:
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

    def check(self) -> None:
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
        need(
            self.prepare_timeout_s > 0,
            f"data.prepare_timeout_s={self.prepare_timeout_s} must be positive",
        )
