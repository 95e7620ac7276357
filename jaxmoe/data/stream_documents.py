"""Streaming whole examples (`data.streaming` with `data.packing=documents`).

Each lane of stream.py reads its documents in order, as it does for windows of a token
stream, but fills its row with whole examples (formats.py): the next example goes into the
row if it fits the room left, else it starts the lane's next row (next fit: the order of
the documents is kept and nothing is read ahead). Examples longer than the window follow
data.truncation; plain text (data.format=text) is split into window-sized pieces, and a
lane's state (epoch, document, offset) then points into a document. The rows have the
layout of the cached document packing (document_packing.py): segment ids and positions.
"""

import numpy as np

from jaxmoe.data.document_packing import decoder_rows, seq2seq_rows
from jaxmoe.data.formats import ExampleEncoder, fit_decoder_example, fit_seq2seq_example
from jaxmoe.data.stream import StreamBatches


class StreamPackedDocuments(StreamBatches):
    """Endless iterator over this process's rows of each global batch, each row the next
    whole examples of its lane (see the module doc)."""

    def __init__(self, documents, encoder: ExampleEncoder, seq_len, batch_size, seed, rows,
                 truncation: str, targets_len: int = 0):  # fmt: skip
        super().__init__(documents, encoder.tokenizer, seq_len, batch_size, seed, rows)
        self.encoder, self.truncation = encoder, truncation
        self.seq2seq = encoder.format == "seq2seq"
        self.targets_len = int(targets_len or seq_len)
        self._examples: dict[int, dict] = {}  # lane -> {(epoch, doc): fitted example}

    def _example(self, lane: int, epoch: int, doc: int):
        """The fitted example of a lane's document (None: skipped), cached while its row is
        built (an example that did not fit is the next row's first)."""
        cache = self._examples.setdefault(lane, {})
        if (epoch, doc) not in cache:
            if len(cache) >= 2:
                cache.pop(next(iter(cache)))
            example = self.encoder.encode(self.documents[self._doc_index(lane, epoch, doc)])
            if example is not None and self.seq2seq:
                example = fit_seq2seq_example(
                    *example, self.seq_len, self.targets_len, self.truncation
                )
            elif example is not None and self.encoder.format != "text":
                example = fit_decoder_example(*example, self.seq_len, self.truncation)
            cache[(epoch, doc)] = example
        return cache[(epoch, doc)]

    def _piece(self, lane: int, start):
        """(the piece at lane position `start` or None, the position after it)."""
        epoch, doc, offset = (int(x) for x in start)
        example = self._example(lane, epoch, doc)
        after = (epoch, doc + 1, 0)
        if after[1] >= self._lane_docs(lane):
            after = (epoch + 1, 0, 0)
        if example is None or self.encoder.format != "text":
            return example, after
        ids, weights = example  # plain text: window-sized pieces sharing one token
        piece = (
            ids[offset : offset + self.seq_len + 1],
            weights[offset : offset + self.seq_len + 1],
        )
        if offset + self.seq_len + 1 < len(ids):
            after = (epoch, doc, offset + self.seq_len)
        return piece, after

    def _sizes(self, piece) -> tuple[int, int]:
        if self.seq2seq:
            return len(piece[0]), len(piece[1])
        return len(piece[0]) - 1, 0

    def _fill(self, lane: int, start) -> tuple[list, np.ndarray, int]:
        """The pieces of the lane's next row, the lane's position after them, and the
        split's index of the row's first document."""
        position, pieces, first = np.asarray(start, np.int64), [], -1
        room, room2, misses = self.seq_len, self.targets_len, 0
        while True:
            piece, after = self._piece(lane, position)
            if piece is None:
                misses += 1
                if misses > 2 * self._lane_docs(lane):
                    raise ValueError(
                        f"data.streaming: no example of the train split fits train.seq_len="
                        f"{self.seq_len} (data.truncation={self.truncation!r})"
                    )
                position = np.asarray(after, np.int64)
                continue
            need, need2 = self._sizes(piece)
            if need > room or need2 > room2:
                return pieces, position, first
            misses = 0
            if first < 0:
                first = self._doc_index(lane, int(position[0]), int(position[1]))
            pieces.append(piece)
            room, room2 = room - need, room2 - need2
            position = np.asarray(after, np.int64)

    def next_rows(self, local_R: np.ndarray) -> dict[str, np.ndarray]:
        rows = np.flatnonzero(local_R)
        pieces, firsts, counts = [], [], []
        for row in rows:
            lane = int(self.lanes[row])
            mine, self._state_R3[row], first = self._fill(lane, self._state_R3[row])
            pieces += mine
            firsts.append(first)
            counts.append(len(mine))
        first_W = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        ids_B = np.arange(len(rows))
        if self.seq2seq:
            inputs, in_start, in_len = _flat([p[0] for p in pieces])
            targets, tg_start, tg_len = _flat([p[1] for p in pieces])
            batch = seq2seq_rows(inputs, targets, in_start, in_len, tg_start, tg_len, first_W,
                                 ids_B, self.seq_len, self.targets_len)  # fmt: skip
        else:
            ids, start, length = _flat([p[0] for p in pieces])
            weights = np.concatenate([p[1] for p in pieces]) if pieces else np.zeros(0, np.uint8)
            pad = self.tokenizer.pad_id
            batch = decoder_rows(ids, weights, start, length - 1, first_W, ids_B, self.seq_len, pad)
        batch["example_ids"] = np.asarray(firsts, np.int32)
        return batch


def _flat(arrays: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the arrays concatenated, where each starts, their lengths)."""
    lengths = np.array([len(a) for a in arrays], np.int64)
    values = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
    return values, np.cumsum(lengths) - lengths, lengths
