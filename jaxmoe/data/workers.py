"""Batches built in grain worker processes (`data.workers` > 0), not on a thread of the
training process.

One Python thread (prefetch.py) can build batches only as fast as one core: span corruption
or packing of large batches then outruns a fast accelerator step. Here the whole run is one
endless grain dataset over global steps, step k = batch `k mod S` of epoch `k div S` (S steps
an epoch), and grain's `mp_prefetch` builds it in `data.workers` spawned processes: worker w
of W builds steps w, w + W, w + 2W, ... and their batches are handed out round-robin, in step
order. Each batch is a pure function of (train.seed, step, this process's rows), the same
one `TrainBatches` computes, so batches are bit-identical for any worker count, and the state
is TrainBatches' own (epoch, position) after the last batch handed *out*: a checkpoint
written with workers resumes with or without them, at the same batch.

Workers start on the first batch (and again after `set_state`); they memory-map the token
cache themselves instead of receiving a copy of it.
"""

import copy
import os

import numpy as np

from jaxmoe.compat.optional import require
from jaxmoe.data.batches import TrainBatches, epoch_batch_ids

# Far beyond any run's steps, and k + _ENDLESS still fits int64.
_ENDLESS = 1 << 60


class _CacheFile:
    """A memory-mapped token stream, pickled as its file's name (workers map it again)."""

    def __init__(self, tokens_N: np.memmap):
        self.path, self.offset = tokens_N.filename, int(tokens_N.offset)
        self.dtype, self.shape = tokens_N.dtype, tokens_N.shape

    def open(self) -> np.memmap:
        return np.memmap(self.path, self.dtype, "r", self.offset, self.shape)


def _whole_file(tokens_N) -> bool:
    """A memmap of its file's whole data (a view into one cannot be re-mapped by name)."""
    if not isinstance(tokens_N, np.memmap) or not tokens_N.flags.c_contiguous:
        return False
    try:
        return tokens_N.offset + tokens_N.nbytes == os.path.getsize(tokens_N.filename)
    except (OSError, TypeError):
        return False


class StepBatch:
    """Global step -> this process's batch of it, picklable for grain's workers.

    Equal to the `TrainBatches` batch of that step: the ids come from `epoch_batch_ids` of
    `epoch_order(step // steps_per_epoch)`, the tokens from `examples.batch`.
    """

    def __init__(self, train: TrainBatches):
        self.examples, self.epoch_order = train.examples, train.epoch_order
        self.num_examples, self.global_batch_size = train.num_examples, train.global_batch_size
        self.rows, self.steps_per_epoch = train.rows, train.steps_per_epoch
        self._epoch, self._ids_SB = None, None  # the epoch whose ids are at hand

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        epoch, position = divmod(int(step), self.steps_per_epoch)
        if epoch != self._epoch:
            self._ids_SB = epoch_batch_ids(
                self.epoch_order(epoch), epoch, self.num_examples, self.global_batch_size
            )[:, self.rows]
            if len(self._ids_SB) != self.steps_per_epoch:
                raise ValueError(
                    f"data.workers: epoch_order({epoch}) makes {len(self._ids_SB)} steps, not "
                    f"the {self.steps_per_epoch} of every other epoch"
                )
            self._epoch = epoch
        return self.examples.batch(self._ids_SB[position])

    def __getstate__(self) -> dict:
        state = {**self.__dict__, "_epoch": None, "_ids_SB": None}
        tokens_N = self.examples.tokens_N
        if _whole_file(tokens_N):
            state["examples"] = copy.copy(self.examples)
            state["examples"].tokens_N = _CacheFile(tokens_N)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if isinstance(self.examples.tokens_N, _CacheFile):
            self.examples.tokens_N = self.examples.tokens_N.open()


class WorkerBatches:
    """`TrainBatches` built `depth` batches ahead in each of `workers` grain processes.

    Same interface (iteration, get_state / set_state, close) and batches as the wrapped
    TrainBatches; a custom epoch order must keep every epoch's length (a curriculum, which
    reorders epochs as they begin, is refused at config load).
    """

    def __init__(self, train: TrainBatches, workers: int, depth: int):
        if not isinstance(train, TrainBatches):
            raise ValueError(
                f"data.workers={workers} builds cached LM or span-corruption batches only, "
                f"not {type(train).__name__}"
            )
        if workers < 1:
            raise ValueError(f"data.workers={workers} must be at least 1 (0 = in-process)")
        self._train, self.workers, self.depth = train, int(workers), max(int(depth), 1)
        self._iterator = None
        state = train.get_state()
        self._epoch, self._position = state["epoch"], state["position"]

    def __getattr__(self, name):  # num_examples, global_batch_size, steps_per_epoch, ...
        return getattr(self._train, name)

    def __iter__(self) -> "WorkerBatches":
        return self

    def _start(self) -> None:
        grain = require("grain", "data.workers")
        _absl_flags_parsed()
        step_batch = StepBatch(self._train)
        first = self._epoch * step_batch.steps_per_epoch + self._position
        dataset = grain.MapDataset.range(first, first + _ENDLESS).map(step_batch)
        options = grain.MultiprocessingOptions(
            num_workers=self.workers, per_worker_buffer_size=self.depth
        )
        self._iterator = iter(dataset.to_iter_dataset().mp_prefetch(options))

    def __next__(self) -> dict[str, np.ndarray]:
        if self._iterator is None:
            self._start()
        batch = next(self._iterator)
        if self._position >= self._train.steps_per_epoch:  # as TrainBatches counts
            self._epoch, self._position = self._epoch + 1, 0
        self._position += 1
        # Plain arrays: grain's come in shared memory that is unmapped when they are freed,
        # which a device buffer aliasing host memory (CPU) must not outlive.
        return {key: np.array(value) for key, value in batch.items()}

    def get_state(self) -> dict:
        return {**self._train.get_state(), "epoch": self._epoch, "position": self._position}

    def set_state(self, state: dict) -> None:
        self.close()
        self._train.set_state(state)  # checks it
        state = self._train.get_state()
        self._epoch, self._position = state["epoch"], state["position"]

    def set_epoch_order(self, epoch_order) -> None:
        raise ValueError("data.workers > 0 cannot take a new epoch order (data.curriculum)")

    def close(self) -> None:
        """Stops the workers; the wrapped TrainBatches is left at the last batch handed out."""
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None
        self._train.set_state(self.get_state())


def _absl_flags_parsed() -> None:
    """grain 0.2.18 reads an absl flag when it starts workers, which fails before absl has
    parsed the command line; jaxmoe parses its own (argparse), so absl keeps its defaults."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
