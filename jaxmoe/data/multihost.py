"""Several processes on one data set: process 0 prepares it once while the others wait at
a barrier, and each process's rows can be traced (JAXMOE_DATA_TRACE).

Everything `build_data` opens is cached in files that appear atomically, so preparing is
idempotent; this only makes sure it happens once, not N times over the full corpus.
"""

import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable

import numpy as np

from jaxmoe.data.mixture import source_sections
from jaxmoe.data.options import FORMAT_KEYS, DataOptions, TrainSection
from jaxmoe.data.sources import cache_dir, document_split, load_tokenizer, token_stream
from jaxmoe.data.tokenizer import Tokenizer
from jaxmoe.errors import ConfigError
from jaxmoe.storage.temporaries import write_atomically

log = logging.getLogger("jaxmoe")

Barrier = Callable[[str, float], None]  # (name, timeout_s); raises TimeoutError


def prepare(data: DataOptions, train: TrainSection) -> Tokenizer:
    """Prepares everything `build_data` opens (tokenizer, every split's token cache),
    idempotently; returns the tokenizer. A sharded train split (data.shards) is left to the
    processes that read it (shards.prepare_shards)."""
    tokenizer = load_tokenizer(data)
    # A streamed train split is tokenized as it is read, by the process that reads it.
    whole_train = not data.streaming and not data.shards
    for source in source_sections(data):
        for split_key in ("train_split", "eval_split") if whole_train else ("eval_split",):
            if data.packed_documents:  # the example cache, and the packing's line (padding)
                document_split(source, train.seq_len, tokenizer, split_key)
            else:
                token_stream(source, tokenizer, split_key)
    return tokenizer


def prepare_once(
    data: DataOptions, train: TrainSection, process_index: int, barrier: Barrier, report=print
) -> None:
    """Process 0 prepares the data; the others wait for it at `barrier`, then open it.

    With a cache_dir that is not shared between hosts, the others then find nothing and
    prepare their own copy (with a warning): correct, but each host pays the full cost,
    unless data.shards leaves each host only its own shards of the train split.
    If process 0 fails, it still reaches the barrier, so the others stop at once, naming
    its error, instead of waiting out the timeout.
    """
    timeout = data.prepare_timeout_s
    marker = os.path.join(cache_dir(data), "prepared", f"{data_key(data)}.json")
    failure = None
    if process_index == 0:
        start = time.monotonic()
        try:
            prepare(data, train)
            outcome = {"host": socket.gethostname(), "error": None}
        except Exception as e:  # raised again after the barrier
            failure, outcome = e, {"host": socket.gethostname(), "error": str(e)}
        try:
            write_atomically(marker, json.dumps(outcome).encode())
        except OSError as e:
            failure = failure or e
        if failure is None:
            report(f"data: prepared by process 0 in {time.monotonic() - start:.1f} s")
    try:
        barrier("jaxmoe_data_prepared", timeout)
    except TimeoutError as e:
        raise RuntimeError(
            f"process {process_index}: the data was not prepared within "
            f"data.prepare_timeout_s={timeout:g} ({e}); raise it, or prepare the data "
            f"beforehand on one process (`jaxmoe prepare` with the same config)"
        ) from None
    if failure is not None:
        raise failure
    if process_index != 0:
        error = _marker_error(marker)
        if error:
            raise RuntimeError(f"process 0 could not prepare the data: {error}")
        if os.path.exists(marker):
            report(f"data: process {process_index} opens the cache prepared by process 0")
        elif data.shards:  # the train split is each process's own anyway
            report(
                f"data: process {process_index} does not see process 0's cache in "
                f"{cache_dir(data)}: preparing its own tokenizer and eval split"
            )
        else:
            log.warning(
                "data: process %d does not see the cache process 0 prepared in "
                "data.cache_dir=%s (not a shared filesystem?): preparing its own copy "
                "(data.shards, a multiple of the process count, shares the train split out)",
                process_index,
                cache_dir(data),
            )


def _marker_error(marker: str) -> str | None:
    """The error process 0 recorded in its marker, if it recorded one."""
    try:
        with open(marker) as f:
            return json.load(f).get("error")
    except (OSError, ValueError, AttributeError):
        return None


def data_key(data: DataOptions) -> str:
    """A hash of every data key that changes the prepared data."""
    keys = (
        "source",
        "mixture",
        "train_split",
        "eval_split",
        "validation_fraction",
        "text_key",
        "vocab_size",
        "tokenizer",
        "data_dir",
        *FORMAT_KEYS,
    )
    text = "|".join(f"{k}={getattr(data, k)!r}" for k in keys)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


class TracedBatches:
    """Training batches that also append each batch's example ids, one JSON list a line, to
    $JAXMOE_DATA_TRACE/rows_<process>.jsonl: which rows each process read, for debugging
    (and the multi-process tests). Everything else is the wrapped iterator's."""

    def __init__(self, batches, folder: str, process_index: int):
        self._batches = batches
        self._path = os.path.join(folder, f"rows_{process_index}.jsonl")
        try:  # before training starts: not a traceback at the first batch
            os.makedirs(folder, exist_ok=True)
            with open(self._path, "a"):
                pass
        except OSError as error:
            raise ConfigError(
                f"JAXMOE_DATA_TRACE={folder!r}: cannot write {self._path} ({error.strerror}); "
                f"unset it or name a writable folder"
            ) from None

    def __getattr__(self, name):
        return getattr(self._batches, name)

    def __iter__(self) -> "TracedBatches":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._batches)
        with open(self._path, "a") as f:
            f.write(json.dumps(batch["example_ids"].tolist()) + "\n")
        return batch
