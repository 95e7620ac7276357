"""The cached train split in document shards (`data.shards = S`): each process tokenizes and
caches only the shards it reads, so hosts that do not share `data.cache_dir` split the
tokenization between them instead of each doing all of it.

Shard s holds the split's documents [s*D//S, (s+1)*D//S) (D documents, in split order),
tokenized and packed as packing.py packs a whole split, into a token cache of its own
(keyed by the split, the tokenizer and "shard s of S"). Its windows stop at its last token,
so a shard needs no other shard's tokens, and the S streams concatenated are the whole
split's stream. Example ids are global: window i of shard s is `offsets[s] + i`, where
offsets are the window counts of the shards before it (exchanged once between processes).
An encoder-decoder's examples are a shard's span-corrupted raw windows instead (seq2seq.py),
masks drawn from (train.seed, shard, window of the shard).

Every global batch takes B/S rows from each shard, rows [s*B/S, (s+1)*B/S) from shard s,
which walks its own shuffled epochs (seeded by train.seed, its epoch and s), like a
mixture's sources: a smaller shard simply enters its next epoch sooner. With P processes
(P dividing S), process p's rows [pB/P, (p+1)B/P) are exactly those of shards
[pS/P, (p+1)S/P). So the batches depend on S, not on P nor on whether the cache is shared,
and the state is the step alone: any process count dividing S resumes it.
"""

import hashlib
import os
import time
from collections.abc import Callable

import numpy as np

from jaxmoe.data import batches as core
from jaxmoe.data.options import DataOptions, TrainSection
from jaxmoe.data.packing import PackedWindows, load_tokens, write_token_cache
from jaxmoe.data.seq2seq import SpanCorruptionExamples, tokenizer_sentinels
from jaxmoe.data.sources import (
    PACKING_VERSION,
    SplitDocuments,
    cache_dir,
    cache_mirror,
    open_split,
)

# Stacks one array per process, in process order ([P, *shape]): a collective.
Allgather = Callable[[np.ndarray], np.ndarray]
_ORDER_TAG = 0x5A4D5  # keeps the shards' shuffles apart from the other default_rng streams


def document_range(num_documents: int, shard: int, shards: int) -> range:
    """The documents of shard `shard` of `shards`."""
    return range(shard * num_documents // shards, (shard + 1) * num_documents // shards)


def own_shards(shards: int, process_index: int, process_count: int) -> range:
    """The shards process `process_index` of `process_count` reads."""
    per_process = shards // process_count
    return range(process_index * per_process, (process_index + 1) * per_process)


def check_shards(data: DataOptions, batch_size: int, process_count: int) -> int:
    """data.shards, checked against the batch (train.batch_size), the process count and the
    other options."""
    shards = data.shards
    for culprit, unsupported in (
        ("data.streaming=True", data.streaming),
        (f"data.mixture={data.mixture!r}", bool(data.mixture.strip())),
        (f"data.curriculum={data.curriculum!r}", data.curriculum != "none"),
        (f"data.workers={data.workers}", data.workers > 0),
    ):
        if unsupported:
            raise ValueError(
                f"data.shards={shards} shards the cached train split of one source; it "
                f"cannot be combined with {culprit}"
            )
    if shards < 1 or shards % process_count:
        raise ValueError(
            f"data.shards={shards} must be a multiple of the process count {process_count} "
            f"(each process reads whole shards)"
        )
    if batch_size % shards:
        raise ValueError(
            f"train.batch_size={batch_size} must be a multiple of data.shards={shards} "
            f"(every batch takes batch_size/shards rows from each shard)"
        )
    return shards


def _texts(documents, docs: range):
    if hasattr(documents, "texts"):  # tfds_text.TextSource: batched reads
        return documents.texts(docs.start, docs.stop)
    return (documents[i] for i in docs)


def shard_stream(
    data: DataOptions, tokenizer, split: SplitDocuments, shard: int, shards: int
) -> tuple[np.ndarray, bool]:
    """The token stream of shard `shard` (memory-mapped) and whether it was tokenized now
    (False: found in the cache)."""
    key = f"{PACKING_VERSION}|{split.fingerprint}|{tokenizer.sha256}|shard {shard} of {shards}"
    name = f"{split.split}_{hashlib.sha256(key.encode()).hexdigest()[:20]}.npy"
    path = os.path.join(cache_dir(data), "tokens", name)
    mirror = cache_mirror(data, "tokens")
    if os.path.exists(path) or (mirror and mirror.pull(name)):
        return load_tokens(path), False
    docs = document_range(len(split.documents), shard, shards)
    write_token_cache(_texts(split.documents, docs), tokenizer, path)
    if mirror:
        mirror.push(name)
    return load_tokens(path), True


def prepare_shards(
    data: DataOptions,
    batch_size: int,
    tokenizer,
    process_index: int = 0,
    process_count: int = 1,
    report=print,
) -> dict[int, np.ndarray]:
    """The token streams of the train shards process `process_index` of `process_count`
    reads, by shard; tokenizes those the cache lacks and reports how many documents."""
    shards = check_shards(data, batch_size, process_count)
    split = open_split(data, "train_split")
    num_documents = len(split.documents)
    mine = own_shards(shards, process_index, process_count)
    start, streams, tokenized = time.monotonic(), {}, 0
    for shard in mine:
        streams[shard], fresh = shard_stream(data, tokenizer, split, shard, shards)
        tokenized += len(document_range(num_documents, shard, shards)) if fresh else 0
    first = document_range(num_documents, mine.start, shards).start
    last = document_range(num_documents, mine.stop - 1, shards).stop
    names = f"{mine.start}" if len(mine) == 1 else f"{mine.start}-{mine.stop - 1}"
    tokens = sum(int(stream.shape[0]) for stream in streams.values())
    report(
        f"data: process {process_index} reads train shard(s) {names} of {shards} (documents "
        f"[{first}, {last}) of {num_documents}, {tokens} tokens): tokenized {tokenized} "
        f"documents in {time.monotonic() - start:.1f} s"
    )
    return streams


def shard_examples(
    data: DataOptions, train: TrainSection, tokenizer, tokens_N: np.ndarray, shard: int, spans: bool
):
    """The train examples of one shard's stream: windows of seq_len + 1 tokens, or with
    `spans` span-corrupted raw windows, masks drawn from (train.seed, shard, window of the
    shard)."""
    if not spans:
        return PackedWindows(tokens_N, train.seq_len, tokenizer.pad_id, False)
    return SpanCorruptionExamples(
        tokens_N,
        encoder_len=train.seq_len,
        seed=train.seed + (int(shard) << 32),
        tokenizer_vocab=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        sentinels=tokenizer_sentinels(tokenizer),
        noise_density=data.noise_density,
        mean_noise_span=data.mean_noise_span,
    )


def _allgather_int64(allgather: Allgather, values: np.ndarray, process_count: int) -> np.ndarray:
    """[P, *values.shape]: every process's int64 `values`, sent as two int32 halves (JAX
    without x64 would cut int64 to int32)."""
    high, low = np.divmod(np.asarray(values, np.int64), 1 << 31)
    gathered = np.asarray(allgather(np.stack([high, low]).astype(np.int32)), np.int64)
    if gathered.shape[0] != process_count:
        raise RuntimeError(
            f"data.shards: the shard sizes came back from {gathered.shape[0]} processes, not "
            f"{process_count} (is jax.distributed initialized?)"
        )
    return gathered[:, 0] * (1 << 31) + gathered[:, 1]


def local_allgather(value) -> np.ndarray:
    """The allgather of a run with one process."""
    return np.asarray(value)[None]


def sharded_train(
    data: DataOptions,
    train: TrainSection,
    tokenizer,
    process_index: int = 0,
    process_count: int = 1,
    allgather: Allgather | None = None,
    report=print,
    *,
    spans: bool = False,
) -> "ShardedBatches":
    """This process's ShardedBatches: its own shards tokenized (or opened from the cache),
    then every shard's size exchanged with `allgather`, which every process calls."""
    shards = check_shards(data, train.batch_size, process_count)
    if allgather is None:
        if process_count > 1:
            from jax.experimental.multihost_utils import process_allgather as allgather
        else:
            allgather = local_allgather
    seq_len = train.seq_len
    mine = own_shards(shards, process_index, process_count)
    failure, parts = None, {}
    counts = np.full((len(mine), 2), -1, np.int64)  # -1: this process failed
    try:
        streams = prepare_shards(
            data, train.batch_size, tokenizer, process_index, process_count, report
        )
        for row, shard in enumerate(mine):
            parts[shard] = shard_examples(data, train, tokenizer, streams[shard], shard, spans)
            counts[row] = len(parts[shard]), parts[shard].num_tokens
    except Exception as error:  # raised after the exchange, so no process waits for this one
        failure = error
    sizes = _allgather_int64(allgather, counts, process_count).reshape(shards, 2)
    if failure is not None:
        raise failure
    if (sizes < 0).any():
        process = int(np.flatnonzero(sizes[:, 0] < 0)[0]) // len(mine)
        raise RuntimeError(f"process {process} could not prepare its train shards (see its log)")
    empty = np.flatnonzero(sizes[:, 0] == 0)
    if empty.size:
        raise ValueError(
            f"data.shards={shards}: train shard {empty[0]} holds {sizes[empty[0], 1]} tokens, "
            f"not one example of train.seq_len={seq_len}; use fewer shards"
        )
    return ShardedBatches(
        parts,
        sizes[:, 0],
        sizes[:, 1],
        train.batch_size,
        train.seed,
        data.shuffle,
    )


class ShardedBatches:
    """Endless iterator over this process's rows of each global batch of a sharded train
    split (`parts`: its own shards' windows). Same interface and batch layout as
    core.TrainBatches, without epoch orders (a curriculum orders one whole split)."""

    def __init__(
        self,
        parts: dict[int, PackedWindows | SpanCorruptionExamples],
        sizes_S: np.ndarray,
        tokens_S: np.ndarray,
        batch_size: int,
        seed: int,
        shuffle: bool,
    ):
        self.parts = dict(sorted(parts.items()))
        self.sizes_S = np.asarray(sizes_S, np.int64)
        self.num_shards = len(self.sizes_S)
        self.global_batch_size, self.seed, self.shuffle = int(batch_size), int(seed), shuffle
        self.rows_per_shard = self.global_batch_size // self.num_shards
        self.offsets_S = np.concatenate([[0], np.cumsum(self.sizes_S)[:-1]])
        self.num_examples = int(self.sizes_S.sum())
        self.num_tokens = int(np.sum(tokens_S))
        self._step = 0
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def _order(self, shard: int, epoch: int) -> np.ndarray:
        if (shard, epoch) not in self._orders:
            if len(self._orders) >= 2 * len(self.parts):  # a shard spans two epochs at most
                self._orders.pop(next(iter(self._orders)))
            rng = np.random.default_rng([self.seed, int(epoch), _ORDER_TAG, int(shard)])
            self._orders[(shard, epoch)] = rng.permutation(int(self.sizes_S[shard]))
        return self._orders[(shard, epoch)]

    def shard_ids(self, shard: int, step: int) -> np.ndarray:
        """The global example ids shard `shard` gives batch `step`, int64 [B/S] (any
        shard: only the sizes are needed)."""
        positions = step * self.rows_per_shard + np.arange(self.rows_per_shard)
        epochs, ids = np.divmod(positions, self.sizes_S[shard])
        if self.shuffle:
            for epoch in np.unique(epochs):
                mask = epochs == epoch
                ids[mask] = self._order(shard, int(epoch))[ids[mask]]
        return ids + self.offsets_S[shard]

    def __iter__(self) -> "ShardedBatches":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        pieces = []
        for shard, windows in self.parts.items():
            ids = self.shard_ids(shard, self._step)
            piece = windows.batch(ids - self.offsets_S[shard])
            piece["example_ids"] = ids.astype(np.int32)
            pieces.append(piece)
        self._step += 1
        return {key: np.concatenate([piece[key] for piece in pieces]) for key in pieces[0]}

    def get_state(self) -> dict:
        return {
            "step": self._step,
            "shards": self.num_shards,
            "shard_examples": [int(n) for n in self.sizes_S],
            "global_batch_size": self.global_batch_size,
        }

    def set_state(self, state: dict) -> None:
        """Resumes at a position from `get_state` (of any process count dividing S)."""
        if "shards" not in state or "step" not in state:
            raise ValueError(
                f"data state was saved without data.shards; it cannot resume a run with "
                f"data.shards={self.num_shards}"
            )
        mine = self.get_state()
        for key in ("shards", "global_batch_size", "shard_examples"):
            if state[key] != mine[key]:
                saved, now = state[key], mine[key]
                if key == "shard_examples":
                    saved, now = f"{sum(saved)} examples", f"{sum(now)} (or other shard sizes)"
                raise ValueError(
                    f"data state has {key}={saved} but this run has {now}: the data, "
                    f"data.shards or train.batch_size changed since it was saved"
                )
        if int(state["step"]) < 0:
            raise ValueError(f"data state step={state['step']} is negative")
        self._step = int(state["step"])


def build_sharded(
    data: DataOptions,
    train: TrainSection,
    tokenizer,
    process_index: int,
    process_count: int,
    allgather: Allgather | None,
    report,
    *,
    spans: bool = False,
) -> "core.DataBundle":
    """The DataBundle of `data.shards`: a sharded train split, the eval split whole."""
    batches = sharded_train(
        data, train, tokenizer, process_index, process_count, allgather, report, spans=spans
    )
    evals = core.split_examples(data, train, tokenizer, "eval_split", True, spans=spans)
    rows = core.local_rows(train.batch_size, process_index, process_count, "train.batch_size")
    return core.DataBundle(
        tokenizer=tokenizer,
        train=batches,  # pipeline.build_data builds it ahead (pipeline.wrapped)
        eval_batches=core.padded_batches(evals, train.batch_size, rows, None),
        vocab_size=core.model_vocab(tokenizer, spans=spans),
        num_train_examples=batches.num_examples,
        num_eval_examples=len(evals),
        num_train_tokens=batches.num_tokens,
        num_eval_tokens=evals.num_tokens,
    )
