"""Streaming training data (`data.streaming=True`): documents tokenized and packed as they
are read, with no token cache and no tokenization pass before step 1.

The global batch has B rows; row r is a *lane*: in epoch e it reads the documents
order_e[r], order_e[r + B], order_e[r + 2B], ... (order_e: the split's documents shuffled by
(train.seed, e)), each as [BOS] tokens EOS, concatenated, cut into windows of seq_len + 1
tokens that share one token (as packing.py does for the cached stream). A lane that runs out
of documents enters its next epoch. Each process tokenizes only the documents of its own
lanes (its rows), so the hosts share the work; the batches do not depend on the process count.

Span corruption (seq2seq.py) reads non-overlapping windows of its raw length instead
(`window` = `stride`); stream_objectives.py builds it, mixtures and the curriculum on this.
A batch's example_ids are the split's index of the document each window starts in: stable
ids that do not depend on seq_len, the tokenizer or a cache.

The state is, per lane, where its next window starts: (epoch, document of the lane, token
offset). A process knows only its own lanes; `gather_state` joins all of them (a collective,
called by every process when a checkpoint is saved), and any process count can resume them.
"""

import numpy as np

from jaxmoe.data.tokenizer import with_bos


class StreamBatches:
    """Endless iterator over this process's rows of each global batch, read from `documents`
    (random access: len(documents), documents[i] -> str)."""

    def __init__(
        self,
        documents,
        tokenizer,
        seq_len: int,
        batch_size: int,
        seed: int,
        rows: slice,
        window: int | None = None,
    ):
        self.documents, self.tokenizer = documents, tokenizer
        self.seq_len, self.global_batch_size, self.seed = int(seq_len), int(batch_size), int(seed)
        # Tokens per window and where the next starts: LM windows share one token.
        self.window = self.seq_len + 1 if window is None else int(window)
        self.stride = self.seq_len if window is None else self.window
        self.num_documents = len(documents)
        if self.num_documents < self.global_batch_size:
            raise ValueError(
                f"data.streaming: the train split has {self.num_documents} documents, fewer "
                f"than the train.batch_size={self.global_batch_size} lanes that read them"
            )
        self.lanes = np.arange(self.global_batch_size)[rows]
        self._state_R3 = np.zeros((len(self.lanes), 3), np.int64)  # epoch, document, offset
        self._orders: dict[int, np.ndarray] = {}
        self._tokens: dict[int, dict] = {}  # lane -> {(epoch, doc): its tokens}
        self.num_examples = self.num_documents  # for the trainer's start-up line
        self.num_tokens = 0  # unknown until read

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # lanes are at most one epoch apart, nearly always
                self._orders.pop(min(self._orders))
            rng = np.random.default_rng([self.seed, int(epoch)])
            self._orders[epoch] = rng.permutation(self.num_documents)
        return self._orders[epoch]

    def _lane_docs(self, lane: int) -> int:
        """How many documents lane `lane` reads per epoch."""
        return -(-(self.num_documents - lane) // self.global_batch_size)

    def _doc_index(self, lane: int, epoch: int, doc: int) -> int:
        return int(self._order(epoch)[lane + doc * self.global_batch_size])

    def _doc_tokens(self, lane: int, epoch: int, doc: int) -> list[int]:
        cache = self._tokens.setdefault(lane, {})
        if (epoch, doc) not in cache:
            ids = self.tokenizer.encode(self.documents[self._doc_index(lane, epoch, doc)])
            if len(cache) >= 2:  # a window reads forward; the next starts in its last doc
                cache.pop(next(iter(cache)))
            cache[(epoch, doc)] = (
                [*with_bos(self.tokenizer, ids), self.tokenizer.eos_id] if ids else []
            )
        return cache[(epoch, doc)]

    def _window(self, lane: int, start) -> tuple[list[int], tuple[int, int, int], tuple]:
        """The `window` tokens of the lane from position `start`, where the next window
        starts (`stride` tokens on), and where its first token is: (epoch, index of its
        document in the split, offset in that document)."""
        epoch, doc, offset = (int(x) for x in start)
        need, out, after, empty_run, first = self.window, [], None, 0, None
        while len(out) < need:
            tokens = self._doc_tokens(lane, epoch, doc)
            before = len(out)
            out.extend(tokens[offset : offset + need - before])
            if first is None and len(out) > before:
                first = (epoch, self._doc_index(lane, epoch, doc), offset)
            if after is None and len(out) >= self.stride:
                after = (epoch, doc, offset + self.stride - before)
            offset += len(out) - before
            if offset >= len(tokens):
                empty_run = empty_run + 1 if not tokens else 0
                if empty_run > 2 * self._lane_docs(lane):
                    raise ValueError("data.streaming: the train split has no text")
                epoch, doc, offset = epoch, doc + 1, 0
                if doc >= self._lane_docs(lane):
                    epoch, doc = epoch + 1, 0
        return out, after, first

    def __iter__(self) -> "StreamBatches":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return self.next_rows(np.ones(len(self.lanes), bool))

    def next_rows(self, local_R: np.ndarray) -> dict[str, np.ndarray]:
        """The next window of the local rows where `local_R` (bool [B_local]) is set, as a
        batch of those rows; only their lanes move on (a mixture row reads one source)."""
        rows = np.flatnonzero(local_R)
        windows_RW = np.zeros((len(rows), self.window), np.int64)
        starts_R3 = np.zeros((len(rows), 3), np.int64)
        for i, row in enumerate(rows):
            windows_RW[i], self._state_R3[row], starts_R3[i] = self._window(
                int(self.lanes[row]), self._state_R3[row]
            )
        return self.make_batch(windows_RW, starts_R3)

    def make_batch(self, windows_RW: np.ndarray, starts_R3: np.ndarray) -> dict[str, np.ndarray]:
        """A batch of windows int64 [R, window] whose first tokens are at `starts_R3`
        (epoch, document index, offset): unique, whichever lane read them."""
        windows_RW = windows_RW.astype(np.int32)
        return {
            "inputs": windows_RW[:, :-1],
            "targets": windows_RW[:, 1:],
            "weights": np.ones((len(windows_RW), self.seq_len), np.float32),
            "example_ids": starts_R3[:, 1].astype(np.int32),
        }

    def get_state(self) -> dict:
        """This process's lanes only; `gather_state` makes the state of the whole batch."""
        return {"lanes": self._state_R3.tolist(), "local": True}

    def gather_state(self, state: dict, allgather) -> dict:
        """All lanes, in row order, from every process's `get_state`: `allgather(array)`
        stacks one int64 array per process (a collective: every process calls it)."""
        lanes = np.asarray(allgather(np.asarray(state["lanes"], np.int64))).reshape(-1, 3)
        return {
            "stream_lanes": lanes.tolist(),
            "num_documents": self.num_documents,
            "global_batch_size": self.global_batch_size,
        }

    def set_state(self, state: dict) -> None:
        """Resumes from `gather_state` (saved with any process count), or from this
        process's own `get_state`."""
        if state.get("local"):
            self._state_R3 = np.asarray(state["lanes"], np.int64).reshape(-1, 3).copy()
            return
        if "stream_lanes" not in state:
            raise ValueError(
                "data state was saved without data.streaming; it cannot resume a stream"
            )
        for key in ("num_documents", "global_batch_size"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"data state has {key}={state[key]} but this run has {getattr(self, key)}: "
                    f"the data or train.batch_size changed since it was saved"
                )
        self._state_R3 = np.asarray(state["stream_lanes"], np.int64)[self.lanes].copy()
