"""Streaming (`data.streaming=True`) for every objective: span corruption, mixtures and the
curriculum, on top of stream.py's lanes. `build_stream` is core.build_data's streaming
branch.

- **Span corruption** (`model.arch=encoder_decoder`): lane r reads the same documents as an
  LM lane, cut into non-overlapping raw windows of seq2seq's raw length (the longest whose
  corrupted encoder input fits train.seq_len), each corrupted as seq2seq.py does. The mask of
  a window is drawn from (train.seed, where its first token is: epoch, the document's index
  in the split, offset in it), unique in an epoch whichever lane reads it, and drawn again
  by a resumed run.
- **Mixtures** (`data.mixture`): every source has B lanes of its own. Row r of step s reads
  the source that mixture.row_sources picks for (train.seed, s, r) and takes the next window
  of that source's lane r; the other sources' lane r waits. State: the step and every
  source's lanes.
- **Curriculum** (`data.curriculum`): an example is one document, stable id = its index in
  the split (the order of the source's files and records, not a position in a token cache,
  so it does not depend on train.seq_len or the tokenizer). Its row holds the document's
  first train.seq_len + 1 tokens (T5: its first raw window, span-corrupted by (train.seed,
  id)), padded with weight 0 when shorter; tokens past that are not trained. The documents
  are then ordinary examples of core.TrainBatches, so the curriculum, its complexity
  store, the scoring pass, resuming and the process split are those of the cached path.

Across processes: process p reads rows [pB/P, (p+1)B/P) of every batch. LM, span corruption
and mixtures: a lane is a row, lanes read disjoint documents in an epoch (lane r: documents
r, r + B, ... of the epoch's shuffle), so two processes read disjoint documents whose union
is what one process reads, and every batch equals the one-process batch. Curriculum: rows
of TrainBatches, disjoint ids per step and per epoch, the same union.
"""

import numpy as np

from jaxmoe.data import batches as core
from jaxmoe.data.formats import ExampleEncoder
from jaxmoe.data.mixture import Component, component_data, parse_mixture, row_sources
from jaxmoe.data.options import DataOptions, TrainSection
from jaxmoe.data.seq2seq import (
    EXTRA_IDS,
    SPAN_SEED_TAG,
    corrupt,
    corrupt_rows,
    corrupted_lengths,
    raw_length_for,
    sentinel_table,
    span_counts,
    tokenizer_sentinels,
)
from jaxmoe.data.sources import open_split
from jaxmoe.data.stream import StreamBatches
from jaxmoe.data.stream_documents import StreamPackedDocuments
from jaxmoe.data.tokenizer import with_bos

_DOCUMENT_TAG = 0xD0C  # a document example's mask, apart from a cached window's


class SpanCorruption:
    """Span-corruption settings of a run: raw window length, decoder length, sentinels."""

    def __init__(self, data: DataOptions, seq_len: int, tokenizer):
        self.noise = (data.noise_density, data.mean_noise_span)
        self.encoder_len = seq_len
        self.raw_len = raw_length_for(self.encoder_len, *self.noise)
        self.decoder_len = corrupted_lengths(self.raw_len, *self.noise)[1]
        self.eos_id = int(tokenizer.eos_id)
        sentinels = tokenizer_sentinels(tokenizer)
        if sentinels is None:
            sentinels = sentinel_table(tokenizer.vocab_size + EXTRA_IDS - 1, EXTRA_IDS)
        self.sentinels = np.asarray(sentinels, np.int64)
        num_spans = span_counts(self.raw_len, *self.noise)[1]
        if num_spans > len(self.sentinels):
            raise ValueError(
                f"train.seq_len={self.encoder_len}: span corruption masks {num_spans} spans "
                f"per example but there are only {len(self.sentinels)} sentinel ids"
            )

    def batch(self, encoder_rows, target_rows, ids_B) -> dict[str, np.ndarray]:
        """The seq2seq batch layout (SpanCorruptionExamples.batch) of corrupted rows, each
        an EOS-terminated id array, or None for a padding row."""
        b = len(ids_B)
        encoder = np.zeros((b, self.encoder_len), np.int32)
        targets = np.zeros((b, self.decoder_len), np.int32)
        weights = np.zeros((b, self.decoder_len), np.float32)
        for row, (enc, tgt) in enumerate(zip(encoder_rows, target_rows, strict=True)):
            if enc is not None:
                encoder[row, : len(enc)], targets[row, : len(tgt)] = enc, tgt
                weights[row, : len(tgt)] = 1.0
        inputs = np.zeros_like(targets)
        inputs[:, 1:] = targets[:, :-1]
        return {
            "encoder_inputs": encoder,
            "inputs": inputs,
            "targets": targets,
            "weights": weights,
            "example_ids": np.asarray(ids_B, np.int32),
        }


class StreamSpanCorruption(StreamBatches):
    """StreamBatches of span-corrupted raw windows (the batch layout of seq2seq.py)."""

    def __init__(self, documents, tokenizer, spans: SpanCorruption, batch_size, seed, rows):
        self.spans = spans
        super().__init__(
            documents, tokenizer, spans.encoder_len, batch_size, seed, rows, spans.raw_len
        )

    def make_batch(self, windows_RW: np.ndarray, starts_R3: np.ndarray) -> dict[str, np.ndarray]:
        rngs = [np.random.default_rng([SPAN_SEED_TAG, self.seed, *map(int, s)]) for s in starts_R3]
        s = self.spans
        encoder_RE, targets_RD = corrupt_rows(windows_RW, rngs, s.noise, s.sentinels, s.eos_id)
        return s.batch(encoder_RE, targets_RD, starts_R3[:, 1])


class StreamMixture:
    """Endless iterator over this process's rows of each global batch of a streamed mixture
    (see the module docstring); example ids are source k's document ids + offsets[k]."""

    def __init__(self, components: list[Component], streams: list, batch_size, seed, rows):
        self.components, self.streams, self.rows = components, streams, rows
        self.global_batch_size, self.seed = int(batch_size), int(seed)
        self.weights = np.array([c.weight for c in components])
        sizes = np.array([s.num_documents for s in streams], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self.num_documents = [int(n) for n in sizes]
        self.num_examples, self.num_tokens = int(sizes.sum()), 0
        self._step = 0

    def __iter__(self) -> "StreamMixture":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        sources_R = row_sources(self.weights, self.seed, self._step, self.global_batch_size)
        sources_R = sources_R[self.rows]
        self._step += 1
        out = None
        for k in np.unique(sources_R):
            mask = sources_R == k
            part = self.streams[k].next_rows(mask)
            part["example_ids"] = part["example_ids"] + np.int32(self.offsets[k])
            if out is None:
                out = {
                    key: np.zeros((len(sources_R), *v.shape[1:]), v.dtype)
                    for key, v in part.items()
                }
            for key, value in part.items():
                out[key][mask] = value
        return out

    def get_state(self) -> dict:
        """This process's lanes of every source; `gather_state` makes the whole batch's."""
        lanes = [s.get_state()["lanes"] for s in self.streams]
        return {"step": self._step, "lanes": lanes, "local": True}

    def gather_state(self, state: dict, allgather) -> dict:
        """Every source's lanes in row order: `allgather(array)` stacks one int64 array per
        process (a collective: every process calls it)."""
        k, local = len(self.streams), len(self.streams[0].lanes)
        lanes_PKR3 = np.asarray(allgather(np.asarray(state["lanes"], np.int64)))
        lanes_KB3 = lanes_PKR3.reshape(-1, k, local, 3).transpose(1, 0, 2, 3).reshape(k, -1, 3)
        return {
            "step": int(state["step"]),
            "stream_mixture_lanes": lanes_KB3.tolist(),
            "sources": [c.source for c in self.components],
            "num_documents": self.num_documents,
            "global_batch_size": self.global_batch_size,
        }

    def set_state(self, state: dict) -> None:
        """Resumes from `gather_state` (any process count) or this process's `get_state`."""
        if state.get("local"):
            self._step = int(state["step"])
            for stream, lanes in zip(self.streams, state["lanes"], strict=True):
                stream.set_state({"lanes": lanes, "local": True})
            return
        if "stream_mixture_lanes" not in state:
            raise ValueError(
                "data state was saved without data.streaming and data.mixture; it cannot "
                "resume a streamed mixture"
            )
        mine = {
            "sources": [c.source for c in self.components],
            "num_documents": self.num_documents,
            "global_batch_size": self.global_batch_size,
        }
        for key, value in mine.items():
            if state[key] != value:
                raise ValueError(
                    f"data state has {key}={state[key]} but this run has {value}: the "
                    f"mixture, its data or train.batch_size changed since it was saved"
                )
        self._step = int(state["step"])
        for stream, lanes_B3 in zip(self.streams, state["stream_mixture_lanes"], strict=True):
            local = np.asarray(lanes_B3, np.int64)[stream.lanes]
            stream.set_state({"lanes": local.tolist(), "local": True})


class DocumentExamples:
    """One example per document of a split, tokenized when its batch is built (the
    curriculum's streamed examples, see the module docstring). `batch(ids_B)` has the
    layout of PackedWindows.batch, or of SpanCorruptionExamples.batch with `spans`; ids < 0
    give padding rows."""

    def __init__(self, documents, tokenizer, seq_len: int, seed: int, spans=None):
        self.documents, self.tokenizer, self.spans = documents, tokenizer, spans
        self.seq_len, self.seed = int(seq_len), int(seed)
        self.num_tokens = 0  # unknown until read
        self._len = len(documents)

    def __len__(self) -> int:
        return self._len

    def tokens(self, ids_B: np.ndarray) -> list[list[int] | None]:
        """Each document's [BOS] ids EOS, cut to one example (None for ids < 0)."""
        ids_B = np.asarray(ids_B, np.int64)
        if ids_B.size and ids_B.max() >= len(self):
            raise IndexError(f"example ids out of range [0, {len(self)}): {ids_B}")
        real = [int(i) for i in ids_B if i >= 0]
        encoded = iter(self.tokenizer.encode_batch([self.documents[i] for i in real]))
        keep = self.spans.raw_len if self.spans else self.seq_len + 1
        eos = [self.tokenizer.eos_id]
        return [
            [*with_bos(self.tokenizer, next(encoded)), *eos][:keep] if i >= 0 else None
            for i in ids_B
        ]

    def batch(self, ids_B: np.ndarray) -> dict[str, np.ndarray]:
        ids_B = np.asarray(ids_B, np.int64)
        rows = self.tokens(ids_B)
        if self.spans:
            s, corrupted = self.spans, []
            for index, tokens in zip(ids_B, rows, strict=True):
                if tokens is None:
                    corrupted.append((None, None))
                    continue
                rng = np.random.default_rng([SPAN_SEED_TAG, self.seed, _DOCUMENT_TAG, int(index)])
                corrupted.append(corrupt(np.array(tokens), rng, s.noise, s.sentinels, s.eos_id))
            return s.batch([c[0] for c in corrupted], [c[1] for c in corrupted], ids_B)
        pad = int(self.tokenizer.pad_id)
        tokens_BW = np.full((len(ids_B), self.seq_len + 1), pad, np.int32)
        valid_BW = np.zeros(tokens_BW.shape, bool)
        for row, tokens in enumerate(rows):
            if tokens is not None:
                tokens_BW[row, : len(tokens)], valid_BW[row, : len(tokens)] = tokens, True
        return {
            "inputs": tokens_BW[:, :-1],
            "targets": tokens_BW[:, 1:],
            "weights": valid_BW[:, 1:].astype(np.float32),
            "example_ids": ids_B.astype(np.int32),
        }


def open_stream(
    data: DataOptions, train: TrainSection, tokenizer, rows: slice, spans: SpanCorruption | None
):
    """The train split of `data.source` as lanes (LM, span corruption, or whole examples
    with data.packing=documents)."""
    documents = open_split(data, "train_split").documents
    batch_size, seed, seq_len = train.batch_size, train.seed, train.seq_len
    if data.packed_documents:
        encoder = ExampleEncoder(data, tokenizer)
        return StreamPackedDocuments(documents, encoder, seq_len, batch_size, seed, rows,
                                     data.truncation, data.targets_len)  # fmt: skip
    if spans is not None:
        return StreamSpanCorruption(documents, tokenizer, spans, batch_size, seed, rows)
    return StreamBatches(documents, tokenizer, seq_len, batch_size, seed, rows)


def build_stream(
    data: DataOptions,
    train: TrainSection,
    tokenizer,
    process_index: int,
    process_count: int,
    *,
    spans: bool = False,
):
    """The DataBundle of `data.streaming`: train read as it goes, eval from the cache;
    `spans`: T5 span corruption (options.span_corruption)."""
    batch_size = train.batch_size
    rows = core.local_rows(batch_size, process_index, process_count, "train.batch_size")
    corruption = SpanCorruption(data, train.seq_len, tokenizer) if spans else None
    components = parse_mixture(data.mixture)
    if data.curriculum != "none":
        if components:
            raise ValueError(
                f"data.curriculum={data.curriculum!r} orders one source's examples; it "
                f"cannot be combined with data.mixture"
            )
        documents = open_split(data, "train_split").documents
        examples = DocumentExamples(documents, tokenizer, train.seq_len, train.seed, corruption)
        batches = core.TrainBatches(
            data, train, tokenizer, process_index, process_count, examples=examples
        )
        streams, sections = [], [data]
    else:
        sections = [component_data(data, c.source) for c in components] or [data]
        streams = []
        for component, source in zip(components or [None], sections, strict=True):
            try:
                streams.append(open_stream(source, train, tokenizer, rows, corruption))
            except ValueError as e:
                if component is None:
                    raise
                raise ValueError(f"data.mixture source {component.source!r}: {e}") from None
        batches = streams[0]
        if components:
            batches = StreamMixture(components, streams, batch_size, train.seed, rows)
    evals = [
        core.split_examples(source, train, tokenizer, "eval_split", True, spans=spans)
        for source in sections
    ]
    eval_sets = {
        c.name: core.padded_batches(e, batch_size, rows, None)
        for c, e in zip(components, evals, strict=False)  # no components: no sets
    }
    eval_batches = [b for part in eval_sets.values() for b in part]
    return core.DataBundle(
        tokenizer=tokenizer,
        train=batches,  # pipeline.build_data builds it ahead (pipeline.wrapped)
        eval_batches=eval_batches or core.padded_batches(evals[0], batch_size, rows, None),
        vocab_size=core.model_vocab(tokenizer, spans=spans),
        num_train_examples=batches.num_examples,
        num_eval_examples=sum(len(e) for e in evals),
        num_train_tokens=0,  # not known before the stream is read
        num_eval_tokens=sum(e.num_tokens for e in evals),
        eval_sets=eval_sets,
    )
