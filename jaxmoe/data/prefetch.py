"""Batches built ahead on a background thread, off the training loop's critical path.

The loop hands a batch to the device and then waits for the previous step's scalars; while
it waits (the GIL released), this thread builds the next `depth` batches: memory-map reads,
span corruption, mixture assembly. Positions stay exact: `get_state` is the state after the
last batch handed *out*, never after the ones still queued, so a checkpoint resumes at the
same batch with or without prefetching.
"""

import queue
import threading


class Prefetch:
    """Wraps a batch iterator with get_state/set_state (TrainBatches, MixtureBatches)."""

    def __init__(self, batches, depth: int):
        if depth < 1:
            raise ValueError(f"data.prefetch={depth} must be at least 1 (0 turns it off)")
        self._batches, self._depth = batches, int(depth)
        self._thread: threading.Thread | None = None
        self._state = None

    def __getattr__(self, name):  # num_examples, global_batch_size, ...
        return getattr(self._batches, name)

    def _start(self) -> None:
        self._state = self._batches.get_state()
        self._queue: queue.Queue = queue.Queue(maxsize=self._depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="jaxmoe-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        while not self._stop.is_set():
            try:
                item = (next(self._batches), self._batches.get_state())
            except BaseException as error:  # handed to the consumer, raised there
                item = error
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def __iter__(self) -> "Prefetch":
        return self

    def __next__(self):
        if self._thread is None:
            self._start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        batch, self._state = item
        return batch

    def get_state(self) -> dict:
        return self._batches.get_state() if self._thread is None else self._state

    def set_state(self, state: dict) -> None:
        self.close()
        self._batches.set_state(state)

    def close(self) -> None:
        """Stops the thread; the wrapped iterator is left at the last batch handed out."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self._state is not None:
            self._batches.set_state(self._state)
