"""Packing whole examples into windows (`data.packing=documents`), with segment ids.

A split's examples (formats.py: ids and loss weights, or a seq2seq pair) are tokenized once
into an *example cache*: per column, one flat .npy of every example's values and an
.offsets.npy of where each starts ([n + 1]), written atomically, then a .json that marks the
cache complete and counts what was read.

Windows: each example becomes one *piece* of n - 1 predictions (decoder-only; a seq2seq
piece is its (encoder, decoder) lengths). A piece longer than the window is cut from the
left or dropped (data.truncation, formats.py), except plain text (data.format=text), which
is split into window-sized pieces, every token a target once. Pieces go into windows by
best fit, longest first: each into the open window with the least room that still holds it
(the encoder side decides for seq2seq, among the first few candidates that also hold its
decoder side), else a new window. The plan depends only on the example lengths, so every
process makes the same one. The share of padding is printed when a split is packed.

A window's row holds its pieces one after the other: the document k of the row (k = 1, 2,
...) has segment id k and positions 0, 1, ...; the rest is padding (segment 0, weight 0).
Decoder-only: inputs x[:-1], targets x[1:], weights w[1:] of each piece. Seq2seq: the
encoder row packs the inputs, the decoder row the targets, shifted right within each
document with 0 as its start (T5X's packed layout, `*_segment_ids` / `*_positions`).
"""

import hashlib
import json
import os
from bisect import bisect_left, insort

import numpy as np

from jaxmoe.data.formats import ExampleEncoder
from jaxmoe.data.packing import NpyWriter, token_dtype
from jaxmoe.storage.temporaries import write_atomically

_SEQ2SEQ_CANDIDATES = 16  # windows a seq2seq piece tries, by encoder room, before a new one


def cache_complete(stem: str) -> bool:
    return os.path.exists(stem + ".json")


def example_columns(encoder: ExampleEncoder) -> tuple[str, ...]:
    """The columns of an encoder's example cache (`routing`: model.moe.replay's experts)."""
    if encoder.format == "seq2seq":
        return ("inputs", "targets")
    return ("ids", "weights", "routing") if encoder.routing is not None else ("ids", "weights")


def write_example_cache(documents, encoder: ExampleEncoder, stem: str) -> None:
    """Encodes `documents` into the example cache `stem`.* (see the module doc): one example
    per document, two for a preference record (chosen, then rejected)."""
    columns = example_columns(encoder)
    id_dtype = token_dtype(encoder.tokenizer.vocab_size)
    dtypes = {name: (np.uint8 if name == "weights" else id_dtype) for name in columns}
    if "routing" in columns:  # [n, M * K] rows per example, stored flat
        dtypes["routing"] = np.int16
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    writers = {name: NpyWriter(f"{stem}.{name}.npy", dtypes[name]) for name in columns}
    lengths = {name: [] for name in columns}
    read = skipped = 0
    try:
        for document in documents:  # per example: a chat template renders one at a time
            read += 1
            examples = encoder.encode_all(document)
            if not examples:
                skipped += 1
            for example in examples:
                for name, values in zip(columns, example, strict=True):
                    writers[name].append(np.asarray(values, dtypes[name]))
                    lengths[name].append(len(values))
        for name in columns:
            writers[name].close()
            offsets = np.concatenate([[0], np.cumsum(lengths[name], dtype=np.int64)])
            with NpyWriter(f"{stem}.{name}.offsets.npy", np.int64) as writer:
                writer.append(offsets.astype(np.int64))
    finally:
        for writer in writers.values():
            writer.discard()
    meta = {"columns": list(columns), "documents": read, "empty": skipped}
    if encoder.routing is not None:
        meta["routing_shape"] = [len(encoder.routing.layers), encoder.routing.slots]
    write_atomically(stem + ".json", json.dumps(meta).encode())  # the cache is complete


def load_example_cache(stem: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{column: (values memory-mapped, offsets [n + 1])} of a complete example cache."""
    with open(stem + ".json") as f:
        meta = json.load(f)
    columns = {
        name: (
            np.load(f"{stem}.{name}.npy", mmap_mode="r", allow_pickle=False),
            np.load(f"{stem}.{name}.offsets.npy", allow_pickle=False),
        )
        for name in meta["columns"]
    }
    if "routing" in columns:  # [M, K] experts per token, like the ids
        values, offsets = columns["routing"]
        columns["routing"] = (values.reshape(-1, *meta["routing_shape"]), offsets)
    return columns


def cache_files(stem: str, columns) -> list[str]:
    """The file names of an example cache (for a remote mirror), the marker last."""
    base = os.path.basename(stem)
    names = [f"{base}.{c}{tail}" for c in columns for tail in (".npy", ".offsets.npy")]
    return [*names, f"{base}.json"]


def cache_key(*parts: str) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


# --------------------------------------------------------------------------- pieces


def decoder_pieces(offsets: np.ndarray, weights: np.ndarray, window: int, mode: str):
    """(start, end) token spans [P] of the pieces of decoder-only examples, and the counts
    {"cut": examples cut from the left, "dropped": examples left out}. mode: "split" (plain
    text: long examples in window-sized pieces sharing one token), "left" or "drop"
    (formats.py: `left` keeps the last scored run whole, with the token before it)."""
    start_N, end_N = offsets[:-1].astype(np.int64), offsets[1:].astype(np.int64)
    long_N = end_N - start_N - 1 > window
    if mode == "split":
        count_N = np.maximum(-(-(end_N - start_N - 1) // window), 1)
        first_P = np.repeat(start_N, count_N)
        k_P = np.arange(count_N.sum()) - np.repeat(np.cumsum(count_N) - count_N, count_N)
        starts = first_P + k_P * window
        ends = np.minimum(starts + window + 1, np.repeat(end_N, count_N))
        keep = ends - starts >= 2
        return starts[keep], ends[keep], {"split": int(long_N.sum()), "dropped": 0}
    last_run_N = last_scored_run(offsets, weights)
    keep = last_run_N > start_N  # something is scored past the first token
    if mode == "left":
        cut_N = np.where(long_N, end_N - window - 1, start_N)
        keep &= cut_N < last_run_N  # the last scored run keeps the token before it
        start_N = cut_N
    else:
        keep &= ~long_N
    counts = {"cut": int((long_N & keep).sum()) if mode == "left" else 0,
              "dropped": int((~keep).sum())}  # fmt: skip
    return start_N[keep], end_N[keep], counts


def pair_pieces(offsets: np.ndarray, weights: np.ndarray, window: int):
    """(start, end) token spans of preference pairs (examples 2i and 2i + 1) that fit one
    window whole, each with something scored, and the count of pairs left out."""
    start_N, end_N = offsets[:-1].astype(np.int64), offsets[1:].astype(np.int64)
    predictions_N = end_N - start_N - 1
    scored_N = last_scored_run(offsets, weights) > start_N
    fits = predictions_N[0::2] + predictions_N[1::2] <= window
    keep = np.repeat(scored_N[0::2] & scored_N[1::2] & fits, 2)
    return start_N[keep], end_N[keep], {"pairs dropped": int((~keep[0::2]).sum())}


def last_scored_run(offsets: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """int64 [n]: where each example's last run of scored targets starts (a first token's
    weight is never a target's); its start when nothing is scored."""
    starts = offsets[:-1].astype(np.int64)
    if not len(weights):
        return starts
    w = np.asarray(weights, bool).copy()
    w[starts[starts < len(w)]] = False
    run_start = w & np.concatenate([[True], ~w[:-1]])
    marked = np.where(run_start, np.arange(len(w)), -1)
    last = np.maximum.reduceat(marked, np.minimum(starts, len(w) - 1))
    return np.where((last > starts) & (offsets[1:] > starts), last, starts)


def best_fit(lengths_P: np.ndarray, capacity: int, second_P=None, second_capacity: int = 0):
    """Window index [P] of each piece: best fit, longest first (see the module doc). With
    `second_P`, a piece also needs that much of a window's second room (seq2seq decoder)."""
    order = np.argsort(-np.asarray(lengths_P), kind="stable")
    window_P = np.empty(len(lengths_P), np.int64)
    rooms: dict[int, list[int]] = {}  # room left -> the open windows with that room
    keys: list[int] = []  # the rooms of `rooms`, sorted
    second: list[int] = []  # each window's second room left
    for piece in order.tolist():
        need = int(lengths_P[piece])
        need2 = 0 if second_P is None else int(second_P[piece])
        found = _take(rooms, keys, need, lambda w, need2=need2: second[w] >= need2)
        window, room = found if found else (len(second), capacity)
        if not found:
            second.append(second_capacity)
        second[window] -= need2
        window_P[piece] = window
        if room - need > 0:
            if room - need not in rooms:
                rooms[room - need] = []
                insort(keys, room - need)
            rooms[room - need].append(window)
    return window_P


def _take(rooms: dict, keys: list, need: int, fits) -> tuple[int, int] | None:
    """(window, its room): removed from `rooms`, the one with the least room >= need that
    `fits`, among the first _SEQ2SEQ_CANDIDATES tried; None if none."""
    tried = 0
    for key in keys[bisect_left(keys, need) :]:
        windows = rooms[key]
        for j in range(len(windows) - 1, -1, -1):
            if fits(windows[j]):
                window = windows.pop(j)
                if not windows:
                    del rooms[key]
                    keys.remove(key)
                return window, key
            tried += 1
            if tried >= _SEQ2SEQ_CANDIDATES:
                return None
    return None


def seq2seq_pieces(inputs_offsets, targets_offsets, encoder_len, decoder_len, mode):
    """(input spans, target spans, counts) of seq2seq examples fitted to their windows:
    inputs longer than `encoder_len` cut from the left (mode "left") or dropped; targets
    longer than `decoder_len` dropped (they are what is scored)."""
    in_start, in_end = inputs_offsets[:-1].astype(np.int64), inputs_offsets[1:].astype(np.int64)
    tg_start, tg_end = targets_offsets[:-1].astype(np.int64), targets_offsets[1:].astype(np.int64)
    long_in = in_end - in_start > encoder_len
    keep = tg_end - tg_start <= decoder_len
    if mode == "left":
        in_start = np.where(long_in, in_end - encoder_len, in_start)
    else:
        keep &= ~long_in
    counts = {"cut": int((long_in & keep).sum()) if mode == "left" else 0,
              "dropped": int((~keep).sum())}  # fmt: skip
    return (in_start[keep], in_end[keep]), (tg_start[keep], tg_end[keep]), counts


class _Layout:
    """Where the pieces of some windows go in a batch's rows: per piece q (in row order) its
    row, segment id and first column; per token its piece and offset in it."""

    def __init__(self, first_W: np.ndarray, ids_B: np.ndarray, lengths_P: np.ndarray):
        real_B = ids_B >= 0
        windows = np.where(real_B, ids_B, 0)
        count_B = np.where(real_B, first_W[windows + 1] - first_W[windows], 0)
        starts_B = first_W[windows]
        before_B = np.cumsum(count_B) - count_B
        total = int(count_B.sum())
        self.row_Q = np.repeat(np.arange(len(ids_B)), count_B)
        rank_Q = np.arange(total) - np.repeat(before_B, count_B)
        self.piece_Q = np.repeat(starts_B, count_B) + rank_Q  # index into the sorted pieces
        self.segment_Q = rank_Q + 1
        self.length_Q = lengths_P[self.piece_Q]
        ends_Q = np.cumsum(self.length_Q)
        starts_Q = ends_Q - self.length_Q  # where each piece's tokens start, all rows together
        base_B = np.zeros(len(ids_B), np.int64)  # where each row's first piece starts
        base_B[count_B > 0] = starts_Q[before_B[count_B > 0]]
        self.column_Q = starts_Q - base_B[self.row_Q]
        self.token_q = np.repeat(np.arange(total), self.length_Q)
        self.offset_T = np.arange(int(ends_Q[-1]) if total else 0) - starts_Q[self.token_q]

    def place(self, out_BL: np.ndarray, values_T: np.ndarray) -> np.ndarray:
        out_BL[self.row_Q[self.token_q], self.column_Q[self.token_q] + self.offset_T] = values_T
        return out_BL


class PackedDocuments:
    """The windows of one split (`data.packing=documents`), addressed by index like
    PackedWindows: `batch(ids_B)` gives rows of whole examples with segment ids and
    positions (batch_fields.py); ids < 0 give padding rows."""

    def __init__(
        self,
        columns: dict,
        seq_len: int,
        pad_id: int,
        mode: str,
        targets_len: int = 0,
        pairs: bool = False,
    ):
        """`pairs` (data.format=preference): examples 2i and 2i + 1 are one pair, packed
        into one window as consecutive documents; a pair that does not fit whole is left
        out (counted)."""
        self.seq_len, self.pad_id = int(seq_len), int(pad_id)
        self.routing = columns["routing"][0] if "routing" in columns else None
        self.seq2seq = "targets" in columns
        if self.seq2seq:
            self.targets_len = int(targets_len or seq_len)
            (self.inputs, in_off), (self.targets, tg_off) = columns["inputs"], columns["targets"]
            spans_in, spans_tg, self.counts = seq2seq_pieces(
                in_off, tg_off, self.seq_len, self.targets_len, mode
            )
            lengths = spans_in[1] - spans_in[0]
            second = spans_tg[1] - spans_tg[0]
            window_P = best_fit(lengths, self.seq_len, second, self.targets_len)
            order = np.lexsort((np.arange(len(window_P)), window_P))
            self.in_start, self.in_len = spans_in[0][order], lengths[order]
            self.tg_start, self.tg_len = spans_tg[0][order], second[order]
            self.num_tokens = int(self.in_len.sum() + self.tg_len.sum())
            capacity = self.seq_len + self.targets_len
        else:
            (self.ids, offsets), (self.weights, _) = columns["ids"], columns["weights"]
            if pairs:
                starts, ends, self.counts = pair_pieces(offsets, self.weights, self.seq_len)
                lengths = ends - starts - 1
                window_P = np.repeat(best_fit(lengths[0::2] + lengths[1::2], self.seq_len), 2)
            else:
                starts, ends, self.counts = decoder_pieces(
                    offsets, self.weights, self.seq_len, mode
                )
                window_P = best_fit(ends - starts - 1, self.seq_len)
            order = np.lexsort((np.arange(len(window_P)), window_P))
            self.start_P, self.length_P = starts[order], (ends - starts - 1)[order]
            self.num_tokens = int(self.length_P.sum())
            capacity = self.seq_len
        num_windows = int(window_P.max()) + 1 if len(window_P) else 0
        self.first_W = np.concatenate(
            [[0], np.cumsum(np.bincount(window_P, minlength=num_windows))]
        )
        self.num_pieces = len(window_P)
        self.padding = 1 - self.num_tokens / max(num_windows * capacity, 1)

    def __len__(self) -> int:
        return len(self.first_W) - 1

    def describe(self) -> str:
        """Counts and the share of padding, for the line printed when a split is packed."""
        what = [f"{self.num_pieces} examples in {len(self)} windows"]
        what += [f"{n} {kind}" for kind, n in self.counts.items() if n]
        return f"{', '.join(what)}; padding {100 * self.padding:.1f}% of the tokens"

    def _check(self, ids_B: np.ndarray) -> np.ndarray:
        ids_B = np.asarray(ids_B, np.int64)
        if ids_B.size and ids_B.max() >= len(self):
            raise IndexError(f"example ids out of range [0, {len(self)}): {ids_B}")
        return ids_B

    def batch(self, ids_B: np.ndarray) -> dict[str, np.ndarray]:
        ids_B = self._check(ids_B)
        if self.seq2seq:
            pieces = (self.inputs, self.targets, self.in_start, self.in_len, self.tg_start)
            lengths = (self.seq_len, self.targets_len)
            return seq2seq_rows(*pieces, self.tg_len, self.first_W, ids_B, *lengths)
        pieces = (self.ids, self.weights, self.start_P, self.length_P, self.first_W)
        return decoder_rows(*pieces, ids_B, self.seq_len, self.pad_id, self.routing)


def decoder_rows(
    ids, weights, start_P, length_P, first_W, ids_B, length: int, pad_id: int, routing=None
):
    """The decoder-only batch of windows `ids_B`: window w holds pieces [first_W[w],
    first_W[w + 1]), piece p the length_P[p] + 1 tokens of ids / weights from start_P[p].
    `routing` (per token [M, K], -1 unused): each input position's recorded experts."""
    b = len(ids_B)
    layout = _Layout(first_W, ids_B, length_P)
    source_T = start_P[layout.piece_Q][layout.token_q] + layout.offset_T
    inputs = np.full((b, length), pad_id, np.int32)
    targets = np.full((b, length), pad_id, np.int32)
    extra = {}
    if routing is not None:
        replayed = np.full((b, length, *routing.shape[1:]), -1, np.int32)
        extra["routing"] = layout.place(replayed, routing[source_T])
    return extra | {
        "inputs": layout.place(inputs, ids[source_T]),
        "targets": layout.place(targets, ids[source_T + 1]),
        "weights": layout.place(np.zeros((b, length), np.float32), weights[source_T + 1]),
        "segment_ids": layout.place(
            np.zeros((b, length), np.int32), layout.segment_Q[layout.token_q]
        ),
        "positions": layout.place(np.zeros((b, length), np.int32), layout.offset_T),
        "example_ids": np.asarray(ids_B, np.int32),
    }


def seq2seq_rows(
    inputs, targets, in_start, in_len, tg_start, tg_len, first_W, ids_B, encoder_len, decoder_len
):
    """The encoder-decoder batch of windows `ids_B` (as decoder_rows; piece p is in_len[p]
    encoder ids from in_start[p] and tg_len[p] target ids from tg_start[p]). The decoder
    reads each document's targets shifted right, 0 as its start (T5)."""
    b = len(ids_B)
    enc = _Layout(first_W, ids_B, in_len)
    dec = _Layout(first_W, ids_B, tg_len)
    enc_source_T = in_start[enc.piece_Q][enc.token_q] + enc.offset_T
    dec_source_T = tg_start[dec.piece_Q][dec.token_q] + dec.offset_T
    targets_T = targets[dec_source_T]
    shifted_T = np.where(dec.offset_T > 0, targets[np.maximum(dec_source_T - 1, 0)], 0)

    def zeros(length, dtype=np.int32):
        return np.zeros((b, length), dtype)

    return {
        "encoder_inputs": enc.place(zeros(encoder_len), inputs[enc_source_T]),
        "encoder_segment_ids": enc.place(zeros(encoder_len), enc.segment_Q[enc.token_q]),
        "encoder_positions": enc.place(zeros(encoder_len), enc.offset_T),
        "inputs": dec.place(zeros(decoder_len), shifted_T),
        "targets": dec.place(zeros(decoder_len), targets_T),
        "weights": dec.place(zeros(decoder_len, np.float32), np.ones(len(targets_T), np.float32)),
        "segment_ids": dec.place(zeros(decoder_len), dec.segment_Q[dec.token_q]),
        "positions": dec.place(zeros(decoder_len), dec.offset_T),
        "example_ids": np.asarray(ids_B, np.int32),
    }
