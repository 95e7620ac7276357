"""Examples and batches for training and evaluation, below the entry point
(pipeline.build_data) and the modules it builds on (shards, stream_objectives, workers).

Examples are addressed by integer index: packed LM windows (packing.py), or for
`model.arch = "encoder_decoder"` span-corrupted windows (seq2seq.py). The order of an
epoch is an explicit, replaceable function `epoch_order(epoch) -> example ids` (default: a
shuffle seeded by (train.seed, epoch)); the curriculum supplies its own. A global batch is
`train.batch_size` consecutive ids of that order; process p of P takes rows
[p*B/P, (p+1)*B/P), so the global batch never depends on the number of processes.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from jaxmoe.compat.optional import require
from jaxmoe.data.document_packing import PackedDocuments
from jaxmoe.data.mixture import MixtureBatches
from jaxmoe.data.options import DataOptions, TrainSection
from jaxmoe.data.packing import PackedWindows
from jaxmoe.data.seq2seq import (
    EXTRA_IDS,
    SpanCorruptionExamples,
    span_corruption_split,
    tokenizer_sentinels,
)
from jaxmoe.data.sources import document_split, packed_split
from jaxmoe.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    import grain

Batch = dict[str, np.ndarray]
EpochOrder = Callable[[int], np.ndarray]
Examples = PackedWindows | SpanCorruptionExamples | PackedDocuments


def split_examples(
    data: DataOptions,
    train: TrainSection,
    tokenizer: Tokenizer,
    split_key: str,
    partial_last: bool,
    *,
    spans: bool = False,
    routing=None,
) -> Examples:
    """The examples of `data.<split_key>` for the model's task: whole documents packed with
    segment ids (data.packing=documents, the fine-tuning formats), else LM windows of one
    token stream, or span corruption where `spans` (options.span_corruption: an
    encoder-decoder reading text)."""
    if data.packed_documents:
        return document_split(data, train.seq_len, tokenizer, split_key, routing=routing)
    if spans:
        return span_corruption_split(data, train, tokenizer, split_key, partial_last)
    return packed_split(data, train.seq_len, tokenizer, split_key, partial_last)


def default_epoch_order(epoch: int, *, num_examples: int, seed: int, shuffle: bool) -> np.ndarray:
    """All example ids, shuffled by (seed, epoch) or in order; int64 [num_examples]."""
    if not shuffle:
        return np.arange(num_examples, dtype=np.int64)
    return np.random.default_rng([int(seed), int(epoch)]).permutation(num_examples)


def local_rows(batch_size: int, process_index: int, process_count: int, key: str) -> slice:
    """Rows of a global batch that this process reads."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, {process_count})")
    if batch_size < 1 or batch_size % process_count:
        raise ValueError(
            f"{key}={batch_size} must be a positive multiple of the process count {process_count}"
        )
    local = batch_size // process_count
    return slice(process_index * local, (process_index + 1) * local)


def epoch_batch_ids(order, epoch: int, num_examples: int, global_batch_size: int) -> np.ndarray:
    """The global batches of an epoch from its order: example ids [steps, B] (the ids left
    over after the last full batch are skipped)."""
    order = np.asarray(order)
    if order.ndim != 1 or not np.issubdtype(order.dtype, np.integer):
        raise ValueError(f"epoch_order({epoch}) must be 1-D integer ids, got {order.dtype}")
    if len(order) < global_batch_size:
        raise ValueError(
            f"epoch_order({epoch}) has {len(order)} ids, fewer than train.batch_size="
            f"{global_batch_size}"
        )
    if order.min() < 0 or order.max() >= num_examples:
        raise ValueError(f"epoch_order({epoch}) has ids outside [0, {num_examples})")
    steps = len(order) // global_batch_size
    return order[: steps * global_batch_size].reshape(steps, -1)


class TrainBatches:
    """Endless iterator over this process's part of each global training batch.

    Yields dicts: inputs, targets int32 [B_local, L] (targets = inputs shifted by one),
    weights float32 [B_local, L] (all 1.0), example_ids int32 [B_local] (global ids); an
    encoder-decoder adds encoder_inputs (see seq2seq.py).
    Examples left over after the last full global batch of an epoch are skipped.
    """

    def __init__(
        self,
        data: DataOptions,
        train: TrainSection,
        tokenizer: Tokenizer,
        process_index: int = 0,
        process_count: int = 1,
        epoch_order: EpochOrder | None = None,
        examples: Examples | None = None,  # default: the split's cached examples
        *,
        spans: bool = False,
        routing=None,
    ):
        if examples is None:
            examples = split_examples(
                data, train, tokenizer, "train_split", False, spans=spans, routing=routing
            )
        self.examples = examples
        self.num_examples = len(self.examples)
        self.global_batch_size = train.batch_size
        self._rows = local_rows(
            self.global_batch_size, process_index, process_count, "train.batch_size"
        )
        if self.num_examples < self.global_batch_size:
            raise ValueError(
                f"train.seq_len={train.seq_len}: the train split of "
                f"data.source={data.source!r} ({self.examples.num_tokens} tokens) makes "
                f"{self.num_examples} examples, fewer than train.batch_size="
                f"{self.global_batch_size}"
            )
        self.epoch_order = epoch_order or functools.partial(
            default_epoch_order,
            num_examples=self.num_examples,
            seed=train.seed,
            shuffle=data.shuffle,
        )
        self._epoch = 0
        self._position = 0  # batches already yielded in this epoch
        self._epoch_batches: grain.MapDataset | None = None

    def set_epoch_order(self, epoch_order: EpochOrder) -> None:
        """Replaces the order function; it applies from the next epoch the iterator enters."""
        self.epoch_order = epoch_order

    def _batches_of_epoch(self, epoch: int) -> "grain.MapDataset":
        """The epoch's local batches as a random-access grain dataset (index = step)."""
        # Imported here: grain imports jax (~0.7 s), and jaxmoe.data should stay cheap to
        # import for tools that only prepare data.
        grain = require("grain", "training batches")

        order = self.epoch_order(epoch)
        ids_SB = epoch_batch_ids(order, epoch, self.num_examples, self.global_batch_size)
        return grain.MapDataset.source(ids_SB[:, self._rows]).map(self.examples.batch)

    @property
    def rows(self) -> slice:
        """This process's rows of every global batch."""
        return self._rows

    @property
    def steps_per_epoch(self) -> int:
        if self._epoch_batches is None:
            self._epoch_batches = self._batches_of_epoch(self._epoch)
        return len(self._epoch_batches)

    def __iter__(self) -> "TrainBatches":
        return self

    def __next__(self) -> Batch:
        if self._position >= self.steps_per_epoch:
            self._epoch, self._position = self._epoch + 1, 0
            self._epoch_batches = self._batches_of_epoch(self._epoch)
        batch = self._epoch_batches[self._position]
        self._position += 1
        return batch

    def get_state(self) -> dict:
        """JSON-serialisable position: the next batch is step `position` of `epoch`."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "num_examples": self.num_examples,
            "global_batch_size": self.global_batch_size,
        }

    def set_state(self, state: dict) -> None:
        """Resumes at a position from `get_state` (of any process count), without replay.

        With a custom `epoch_order`, it must return the same order for the saved epoch.
        """
        if not {"epoch", "position"} <= set(state):
            raise ValueError(f"data state {state} lacks 'epoch' or 'position'")
        for key, mine in (
            ("num_examples", self.num_examples),
            ("global_batch_size", self.global_batch_size),
        ):
            if key in state and int(state[key]) != mine:
                raise ValueError(
                    f"data state has {key}={state[key]} but this run has {mine}: the data "
                    f"or train.batch_size changed since it was saved"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0:
            raise ValueError(f"data state {state} has a negative epoch or position")
        self._epoch, self._position = epoch, position
        self._epoch_batches = self._batches_of_epoch(epoch)
        if position > len(self._epoch_batches):
            raise ValueError(
                f"data state position={position} is past the {len(self._epoch_batches)} "
                f"steps of epoch {epoch}"
            )


def eval_batches(
    data: DataOptions,
    train: TrainSection,
    tokenizer: Tokenizer,
    max_batches: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
    *,
    spans: bool = False,
) -> list[Batch]:
    """All validation windows in order, in batches of train.batch_size (this process's rows).

    LM: every token of the split after the first is a target with weight 1 exactly once.
    Encoder-decoder: every raw window of the split, span-corrupted, once. The last window
    and the last batch are padded with weight 0 (example_ids -1 on padding rows).
    """
    examples = split_examples(data, train, tokenizer, "eval_split", True, spans=spans)
    rows = local_rows(train.batch_size, process_index, process_count, "train.batch_size")
    return padded_batches(examples, train.batch_size, rows, max_batches)


def padded_batches(
    examples: Examples, batch_size: int, rows: slice, max_batches: int | None
) -> list[Batch]:
    """Every example in order, in global batches of batch_size padded with ids -1."""
    num_batches = -(-len(examples) // batch_size)
    if max_batches is not None:
        num_batches = min(num_batches, int(max_batches))
    ids = np.full(num_batches * batch_size, -1, dtype=np.int64)
    real = min(len(examples), ids.size)
    ids[:real] = np.arange(real)
    return [examples.batch(ids_B[rows]) for ids_B in ids.reshape(num_batches, batch_size)]


@dataclasses.dataclass
class DataBundle:
    """Everything the trainer needs from the data side."""

    tokenizer: Tokenizer
    train: TrainBatches | MixtureBatches
    eval_batches: list[Batch]
    vocab_size: int
    num_train_examples: int
    num_eval_examples: int
    num_train_tokens: int
    num_eval_tokens: int
    # With data.mixture: each source's own eval batches by name (eval_batches holds them all).
    eval_sets: dict[str, list[Batch]] = dataclasses.field(default_factory=dict)


def model_vocab(tokenizer: Tokenizer, *, spans: bool = False) -> int:
    """The vocabulary the model needs: span corruption's sentinels sit above the
    tokenizer's ids (T5's extra ids) unless the tokenizer has its own."""
    extra = spans and tokenizer_sentinels(tokenizer) is None
    return tokenizer.vocab_size + (EXTRA_IDS if extra else 0)
