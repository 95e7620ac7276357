"""Batches for training and evaluation: the one entry point is `build_data`.

It opens the cached, sharded (shards.py) or streamed (stream_objectives.py) data named by
`config.data` and builds its batches ahead, on a thread or in grain worker processes
(workers.py). Examples, epoch orders and the batches themselves are batches.py's; its names
are re-exported here for the modules and tests that know them as pipeline.X.
"""

import dataclasses
import os

from jaxmoe.data.batches import (
    Batch,
    DataBundle,
    EpochOrder,
    Examples,
    TrainBatches,
    default_epoch_order,
    epoch_batch_ids,
    eval_batches,
    local_rows,
    model_vocab,
    padded_batches,
    split_examples,
)
from jaxmoe.data.mixture import MixtureBatches, component_data, parse_mixture
from jaxmoe.data.multihost import Barrier, TracedBatches, prepare_once
from jaxmoe.data.options import DataOptions, TrainSection
from jaxmoe.data.prefetch import Prefetch
from jaxmoe.data.shards import build_sharded
from jaxmoe.data.sources import load_tokenizer
from jaxmoe.data.stream_objectives import build_stream
from jaxmoe.data.tokenizer import Tokenizer
from jaxmoe.data.workers import WorkerBatches

__all__ = [
    "Batch",
    "DataBundle",
    "EpochOrder",
    "Examples",
    "TrainBatches",
    "build_data",
    "default_epoch_order",
    "epoch_batch_ids",
    "eval_batches",
    "model_vocab",
    "split_examples",
    "wrapped",
]


def wrapped(batches, data: DataOptions, process_index: int):
    """`batches` built ahead: in `data.workers` grain processes (workers.py), else on a thread
    (`data.prefetch` batches; not with a curriculum, which reorders epochs as they start);
    traced when JAXMOE_DATA_TRACE names a folder."""
    depth, workers = data.prefetch, data.workers
    if workers:
        batches = WorkerBatches(batches, workers, depth)
    elif depth and data.curriculum == "none":
        batches = Prefetch(batches, depth)
    folder = os.environ.get("JAXMOE_DATA_TRACE")
    return TracedBatches(batches, folder, process_index) if folder else batches


def build_data(
    data: DataOptions,
    train: TrainSection,
    *,
    spans: bool = False,
    routing=None,
    process_index: int = 0,
    process_count: int = 1,
    barrier: Barrier | None = None,
    report=print,
    allgather=None,
) -> DataBundle:
    """Prepares (idempotently, cached) and opens the data named by `data`, in windows of
    train.seq_len and global batches of train.batch_size ordered by train.seed; `spans`:
    T5 span corruption (options.span_corruption: an encoder-decoder model reading text);
    `routing` (routing_record.RoutingShape, router replay): the examples' recorded routing
    is read into each batch's `routing` field (whole splits, not shards nor mixtures).

    With several processes and a `barrier`, only process 0 prepares (`prepare_once`); with
    `data.shards`, each process then tokenizes its own train shards (`allgather`: see
    shards.py; default jax's process_allgather).
    """
    if process_count > 1 and barrier is not None:
        prepare_once(data, train, process_index, barrier, report)
    tokenizer = load_tokenizer(data)
    if data.shards:
        bundle = build_sharded(
            data, train, tokenizer, process_index, process_count, allgather, report, spans=spans
        )
        return dataclasses.replace(bundle, train=wrapped(bundle.train, data, process_index))
    if data.streaming:  # every objective, mixtures and the curriculum
        bundle = build_stream(data, train, tokenizer, process_index, process_count, spans=spans)
        return dataclasses.replace(bundle, train=wrapped(bundle.train, data, process_index))
    if parse_mixture(data.mixture):
        return _build_mixture(data, train, tokenizer, process_index, process_count, spans)
    batches = TrainBatches(
        data, train, tokenizer, process_index, process_count, spans=spans, routing=routing
    )
    eval_examples = split_examples(
        data, train, tokenizer, "eval_split", True, spans=spans, routing=routing
    )
    rows = local_rows(batches.global_batch_size, process_index, process_count, "train.batch_size")
    return DataBundle(
        tokenizer=tokenizer,
        train=wrapped(batches, data, process_index),
        eval_batches=padded_batches(eval_examples, batches.global_batch_size, rows, None),
        vocab_size=model_vocab(tokenizer, spans=spans),
        num_train_examples=batches.num_examples,
        num_eval_examples=len(eval_examples),
        num_train_tokens=batches.examples.num_tokens,
        num_eval_tokens=eval_examples.num_tokens,
    )


def _build_mixture(
    data: DataOptions,
    train: TrainSection,
    tokenizer: Tokenizer,
    process_index: int,
    process_count: int,
    spans: bool,
) -> DataBundle:
    """The DataBundle of `data.mixture`: one MixtureBatches, eval split by source."""
    components = parse_mixture(data.mixture)
    if data.curriculum != "none":
        raise ValueError(
            f"data.curriculum={data.curriculum!r} orders one source's examples; it "
            f"cannot be combined with data.mixture"
        )
    batch_size = train.batch_size
    rows = local_rows(batch_size, process_index, process_count, "train.batch_size")
    parts, eval_sets, eval_tokens, eval_examples = [], {}, 0, 0
    for component in components:
        source = component_data(data, component.source)
        part = split_examples(source, train, tokenizer, "train_split", False, spans=spans)
        if len(part) == 0:
            raise ValueError(
                f"data.mixture source {component.source!r} has no train example of "
                f"train.seq_len={train.seq_len} tokens"
            )
        parts.append(part)
        evals = split_examples(source, train, tokenizer, "eval_split", True, spans=spans)
        eval_sets[component.name] = padded_batches(evals, batch_size, rows, None)
        eval_tokens += evals.num_tokens
        eval_examples += len(evals)
    mixture = MixtureBatches(components, parts, batch_size, train.seed, rows)
    return DataBundle(
        tokenizer=tokenizer,
        train=wrapped(mixture, data, process_index),
        eval_batches=[batch for part in eval_sets.values() for batch in part],
        vocab_size=model_vocab(tokenizer, spans=spans),
        num_train_examples=mixture.num_examples,
        num_eval_examples=eval_examples,
        num_train_tokens=mixture.num_tokens,
        num_eval_tokens=eval_tokens,
        eval_sets=eval_sets,
    )
