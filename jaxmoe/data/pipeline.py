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
    _local_rows,
    _padded_batches,
    default_epoch_order,
    epoch_batch_ids,
    eval_batches,
    is_encoder_decoder,
    model_vocab,
    split_examples,
)
from jaxmoe.data.mixture import MixtureBatches, component_config, parse_mixture
from jaxmoe.data.multihost import Barrier, TracedBatches, prepare_once
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
    "_local_rows",
    "_padded_batches",
    "build_data",
    "default_epoch_order",
    "epoch_batch_ids",
    "eval_batches",
    "is_encoder_decoder",
    "model_vocab",
    "split_examples",
    "wrapped",
]


def wrapped(batches, config, process_index: int):
    """`batches` built ahead: in `data.workers` grain processes (workers.py), else on a thread
    (`data.prefetch` batches; not with a curriculum, which reorders epochs as they start);
    traced when JAXMOE_DATA_TRACE names a folder."""
    depth, workers = config.data.prefetch, config.data.workers
    if workers:
        batches = WorkerBatches(batches, workers, depth)
    elif depth and config.data.curriculum == "none":
        batches = Prefetch(batches, depth)
    folder = os.environ.get("JAXMOE_DATA_TRACE")
    return TracedBatches(batches, folder, process_index) if folder else batches


def build_data(
    config,
    process_index: int = 0,
    process_count: int = 1,
    barrier: Barrier | None = None,
    report=print,
    allgather=None,
) -> DataBundle:
    """Prepares (idempotently, cached) and opens the data named by `config.data`.

    With several processes and a `barrier`, only process 0 prepares (`prepare_once`); with
    `data.shards`, each process then tokenizes its own train shards (`allgather`: see
    shards.py; default jax's process_allgather).
    """
    if process_count > 1 and barrier is not None:
        prepare_once(config, process_index, barrier, report)
    tokenizer = load_tokenizer(config)
    if config.data.shards:
        bundle = build_sharded(config, tokenizer, process_index, process_count, allgather, report)
        return dataclasses.replace(bundle, train=wrapped(bundle.train, config, process_index))
    if config.data.streaming:  # every objective, mixtures and the curriculum
        bundle = build_stream(config, tokenizer, process_index, process_count)
        return dataclasses.replace(bundle, train=wrapped(bundle.train, config, process_index))
    if parse_mixture(config.data.mixture):
        return _build_mixture(config, tokenizer, process_index, process_count)
    train = TrainBatches(config, tokenizer, process_index, process_count)
    eval_examples = split_examples(config, tokenizer, "eval_split", partial_last=True)
    rows = _local_rows(train.global_batch_size, process_index, process_count, "train.batch_size")
    return DataBundle(
        tokenizer=tokenizer,
        train=wrapped(train, config, process_index),
        eval_batches=_padded_batches(eval_examples, train.global_batch_size, rows, None),
        vocab_size=model_vocab(config, tokenizer),
        num_train_examples=train.num_examples,
        num_eval_examples=len(eval_examples),
        num_train_tokens=train.examples.num_tokens,
        num_eval_tokens=eval_examples.num_tokens,
    )


def _build_mixture(config, tokenizer: Tokenizer, process_index: int, process_count: int):
    """The DataBundle of `data.mixture`: one MixtureBatches, eval split by source."""
    components = parse_mixture(config.data.mixture)
    if config.data.curriculum != "none":
        raise ValueError(
            f"data.curriculum={config.data.curriculum!r} orders one source's examples; it "
            f"cannot be combined with data.mixture"
        )
    batch_size = config.train.batch_size
    rows = _local_rows(batch_size, process_index, process_count, "train.batch_size")
    parts, eval_sets, eval_tokens, eval_examples = [], {}, 0, 0
    for component in components:
        source_config = component_config(config, component.source)
        part = split_examples(source_config, tokenizer, "train_split", partial_last=False)
        if len(part) == 0:
            raise ValueError(
                f"data.mixture source {component.source!r} has no train example of "
                f"train.seq_len={config.train.seq_len} tokens"
            )
        parts.append(part)
        evals = split_examples(source_config, tokenizer, "eval_split", partial_last=True)
        eval_sets[component.name] = _padded_batches(evals, batch_size, rows, None)
        eval_tokens += evals.num_tokens
        eval_examples += len(evals)
    train = MixtureBatches(components, parts, batch_size, config.train.seed, rows)
    return DataBundle(
        tokenizer=tokenizer,
        train=wrapped(train, config, process_index),
        eval_batches=[batch for batches in eval_sets.values() for batch in batches],
        vocab_size=model_vocab(config, tokenizer),
        num_train_examples=train.num_examples,
        num_eval_examples=eval_examples,
        num_train_tokens=train.num_tokens,
        num_eval_tokens=eval_tokens,
        eval_sets=eval_sets,
    )
