"""Routing complexities of a run on disk: WORKDIR/curriculum/, numpy .npy memmaps (no pickle).

Files (epoch e written with 6 digits):
  run.json                 the curriculum settings of the run (checked when resuming)
  epoch_<e>.frozen.npy     records [N] (seen bool, top2 float32 [M], top2_count and tokens
                           float32 [M]): the complexities the order of epoch e was computed
                           from (e >= 1; epoch 0 has none). top2_count: the example's
                           tokens sent to two experts per layer, tokens: its real tokens
                           (the paper's reference is the fewest top-2 tokens; fractions
                           alone cannot tell a short example from a long one). Stores
                           written before the counts existed have neither field.
  epoch_<e>.order.npy      int64 [N]: the order of epoch e (e >= 1); written after its
                           frozen file, so an order on disk always has its complexities
  epoch_<e>.log.npy        records [S*B] (id int32, top2, top2_count, tokens): routing in
                           epoch e (source previous_epoch); row = step-in-epoch * B + row
                           of the global batch; id -1 = not recorded (yet, or non-finite)
  checkpoints.json         {step: epoch} of the checkpoints saved with this curriculum

Checkpoint S taken at data position (epoch e, position p) saw frozen_e overlaid with log
rows [0, p*B) (`complexities_at`); those rows are flushed before S is saved and never
rewritten by the steps before S, so restoring S restores exactly that. Log rows from p*B
on may hold a later, abandoned run's values: a resumed run overwrites each of them when it
reaches its step, before the epoch boundary reads them. Whole files appear atomically
(written under a temporary name, then renamed); only process 0 writes.
"""

import json
import os
from pathlib import Path

import numpy as np

_TMP = ".tmp"
_CHUNK = 1 << 18  # rows per chunk when streaming through memmaps


def _count_fields(num_layers: int, counts: bool) -> list:
    return [("top2_count", "<f4", (num_layers,)), ("tokens", "<f4", (num_layers,))] * counts


def frozen_dtype(num_layers: int, counts: bool = True) -> np.dtype:
    return np.dtype(
        [("seen", "?"), ("top2", "<f4", (num_layers,)), *_count_fields(num_layers, counts)]
    )


def log_dtype(num_layers: int, counts: bool = True) -> np.dtype:
    return np.dtype(
        [("id", "<i4"), ("top2", "<f4", (num_layers,)), *_count_fields(num_layers, counts)]
    )


def _num_layers(records: np.ndarray) -> int:
    return int(records.dtype["top2"].shape[0])


def has_counts(records: np.ndarray) -> bool:
    """Whether records (frozen or log) carry top2_count and tokens (stores from before the
    counts have only the fractions)."""
    return "tokens" in (records.dtype.names or ())


class ComplexityStore:
    """The files above for a dataset of `num_examples` examples."""

    def __init__(self, root: str | os.PathLike, num_examples: int, writer: bool):
        self.root = Path(root)
        self.num_examples = int(num_examples)
        self.writer = writer
        self._log: tuple[int, np.memmap] | None = None  # (epoch, open log) of the writer
        if writer:
            self.root.mkdir(parents=True, exist_ok=True)

    def path(self, epoch: int, kind: str) -> Path:
        return self.root / f"epoch_{epoch:06d}.{kind}.npy"

    # --- whole files ---------------------------------------------------------------

    def _write_atomic(self, path: Path, array: np.ndarray) -> None:
        if not self.writer:
            raise RuntimeError(f"only process 0 writes {path}")
        tmp = path.with_name(path.name + _TMP)
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=array.dtype, shape=array.shape)
        out[...] = array
        out.flush()
        del out
        os.replace(tmp, path)

    def _read(self, path: Path, what: str) -> np.ndarray:
        if not path.exists():
            raise ValueError(
                f"curriculum: {path} is missing ({what}); the run cannot resume this epoch "
                f"in its original order. Restore the file or start a new --workdir"
            )
        records = np.load(path, mmap_mode="r", allow_pickle=False)
        if records.shape[0] != self.num_examples:
            raise ValueError(
                f"curriculum: {path} covers {records.shape[0]} examples but the train split "
                f"has {self.num_examples}: the data changed since it was written"
            )
        return records

    def write_frozen(
        self, epoch: int, vectors_NM: np.ndarray, seen_N: np.ndarray, counts_NM=None, tokens_NM=None
    ) -> None:
        """Complexities that epoch `epoch` will be ordered by (float32 [N, M], bool [N]), with
        the top-2 and real token counts [N, M] when given."""
        vectors_NM = np.asarray(vectors_NM, dtype=np.float32)
        if vectors_NM.shape[0] != self.num_examples or np.shape(seen_N) != (self.num_examples,):
            raise ValueError(
                f"frozen complexities: expected [{self.num_examples}, M] and "
                f"[{self.num_examples}], got {vectors_NM.shape} and {np.shape(seen_N)}"
            )
        counts = counts_NM is not None
        records = np.zeros(self.num_examples, frozen_dtype(vectors_NM.shape[1], counts))
        records["seen"], records["top2"] = seen_N, vectors_NM
        if counts:
            records["top2_count"], records["tokens"] = counts_NM, tokens_NM
        self._write_atomic(self.path(epoch, "frozen"), records)

    def read_frozen(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(vectors float32 [N, M], seen bool [N]) of epoch `epoch` >= 1, memory-mapped."""
        records = self._read(self.path(epoch, "frozen"), f"the complexities of epoch {epoch}")
        return records["top2"], records["seen"]

    def read_frozen_counts(self, epoch: int) -> np.ndarray | None:
        """Top-2 token counts float32 [N, M] of epoch `epoch`, or None when the store has no
        counts for some seen example (a store written before the counts were kept)."""
        records = self._read(self.path(epoch, "frozen"), f"the complexities of epoch {epoch}")
        if not has_counts(records):
            return None
        seen_N = np.asarray(records["seen"])
        # tokens 0 = a row recorded without counts: its count is unknown, not zero.
        known_N = np.asarray(records["tokens"]).sum(axis=1) > 0
        if np.any(seen_N & ~known_N):
            return None
        return np.asarray(records["top2_count"])

    def write_order(self, epoch: int, order_N: np.ndarray) -> None:
        self._write_atomic(self.path(epoch, "order"), np.asarray(order_N, dtype=np.int64))

    def read_order(self, epoch: int) -> np.ndarray:
        """int64 [N]: the order epoch `epoch` >= 1 was (or will be) trained in."""
        return np.array(self._read(self.path(epoch, "order"), f"the order of epoch {epoch}"))

    # --- the log of the running epoch ------------------------------------------------

    def _open_log(self, epoch: int, num_rows: int, num_layers: int, counts: bool) -> np.memmap:
        if self._log is not None and self._log[0] == epoch:
            return self._log[1]
        self.close_log()
        path = self.path(epoch, "log")
        log = None
        if path.exists():  # a resumed run continues the log its checkpoint saw (kept without
            # counts when an older jaxmoe wrote it: the epoch's reference falls back to means)
            log = np.lib.format.open_memmap(path, mode="r+")
            if log.shape != (num_rows,) or _num_layers(log) != num_layers:
                del log
                log = None
        if log is None:
            empty = np.zeros(num_rows, log_dtype(num_layers, counts))
            empty["id"] = -1
            self._write_atomic(path, empty)
            log = np.lib.format.open_memmap(path, mode="r+")
        self._log = (epoch, log)
        return log

    def record(
        self,
        epoch: int,
        position: int,
        num_rows: int,
        ids_B: np.ndarray,
        top2_BM: np.ndarray,
        counts_BM=None,
        tokens_BM=None,
    ) -> None:
        """Routing of step `position` (0-based) of `epoch`: ids int [B] (-1 = skip), top-2
        fractions [B, M], and the top-2 and real token counts [B, M] when given."""
        batch = len(ids_B)
        counts = counts_BM is not None
        log = self._open_log(epoch, num_rows, int(np.shape(top2_BM)[1]), counts)
        rows = slice(position * batch, (position + 1) * batch)
        log["id"][rows] = ids_B
        log["top2"][rows] = top2_BM
        if has_counts(log):  # tokens 0 marks a count not given (read_frozen_counts)
            log["top2_count"][rows] = counts_BM if counts else 0
            log["tokens"][rows] = tokens_BM if counts else 0

    def flush(self) -> None:
        if self._log is not None:
            self._log[1].flush()

    def close_log(self) -> None:
        if self._log is not None:
            self._log[1].flush()
            self._log = None

    def complexities_at(self, epoch: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(vectors float32 [N, M], seen bool [N]) in memory, as a run saw them after the
        first `rows` log rows of `epoch`: frozen_epoch overlaid with those rows."""
        self.flush()
        log = self._read_log(epoch)
        if epoch > 0:
            records = np.array(self._read(self.path(epoch, "frozen"), "complexities"))
        else:
            records = np.zeros(self.num_examples, frozen_dtype(_num_layers(log), has_counts(log)))
        self._overlay(records, log, rows, epoch)
        return records["top2"], records["seen"]

    def freeze_next(self, epoch: int, rows: int) -> None:
        """Write frozen_(epoch+1) = frozen_epoch overlaid with the log rows [0, rows) of
        `epoch`, streaming through memmaps (nothing of size N * M is held in memory)."""
        self.flush()
        log = self._read_log(epoch)
        path = self.path(epoch + 1, "frozen")
        tmp = path.with_name(path.name + _TMP)
        previous = None
        counts = has_counts(log)
        if epoch > 0:
            previous = self._read(self.path(epoch, "frozen"), f"complexities of epoch {epoch}")
            if _num_layers(previous) != _num_layers(log):
                raise ValueError(
                    f"curriculum: {self.path(epoch, 'frozen')} has {_num_layers(previous)} MoE "
                    f"layers but the routing of epoch {epoch} has {_num_layers(log)}"
                )
            counts = counts and has_counts(previous)
        dtype = frozen_dtype(_num_layers(log), counts)
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(self.num_examples,))
        if previous is not None:  # else zero-filled: nothing seen
            for start in range(0, self.num_examples, _CHUNK):
                part = previous[start : start + _CHUNK]
                for name in dtype.names:
                    out[name][start : start + _CHUNK] = part[name]
        self._overlay(out, log, rows, epoch)
        out.flush()
        del out
        os.replace(tmp, path)

    def _read_log(self, epoch: int) -> np.ndarray:
        path = self.path(epoch, "log")
        if not path.exists():
            raise ValueError(f"curriculum: {path} is missing (the routing of epoch {epoch})")
        return np.load(path, mmap_mode="r", allow_pickle=False)

    @staticmethod
    def _overlay(records: np.ndarray, log: np.ndarray, rows: int, epoch: int) -> None:
        """records[id] = the log's vector for each recorded id among log rows [0, rows)."""
        if _num_layers(records) != _num_layers(log) or rows > len(log):
            raise ValueError(
                f"curriculum: the log of epoch {epoch} ({len(log)} rows of "
                f"{_num_layers(log)} layers) does not fit {rows} rows of "
                f"{_num_layers(records)} layers"
            )
        # An epoch's order is a permutation, so an id occurs at most once in its log.
        for start in range(0, rows, _CHUNK):
            part = log[start : min(start + _CHUNK, rows)]
            ids = part["id"][part["id"] >= 0]
            records["top2"][ids] = part["top2"][part["id"] >= 0]
            if has_counts(records) and has_counts(log):
                for name in ("top2_count", "tokens"):
                    records[name][ids] = part[name][part["id"] >= 0]
            records["seen"][ids] = True

    # --- run settings and garbage collection -------------------------------------------

    def check_run_info(self, info: dict, resuming: bool) -> None:
        """Fail when resuming a run whose curriculum settings differ; record them otherwise."""
        path = self.root / "run.json"
        if resuming and path.exists():
            stored = json.loads(path.read_text())
            for key, value in info.items():
                if key in stored and stored[key] != value:
                    raise ValueError(
                        f"{key}={value!r} but this workdir was trained with {stored[key]!r} "
                        f"({path}): resuming would change the order of the current epoch; "
                        f"use a new --workdir"
                    )
        if self.writer and not (resuming and path.exists()):
            self._write_json(path, info)

    def _write_json(self, path: Path, value) -> None:
        tmp = path.with_name(path.name + _TMP)
        tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
        os.replace(tmp, path)

    def clear(self) -> None:
        """Delete every epoch file and the checkpoint index (a fresh run)."""
        for path in [*self.root.glob("epoch_*.npy*"), self.root / "checkpoints.json"]:
            path.unlink(missing_ok=True)

    def _checkpoint_epochs(self) -> dict[int, int]:
        path = self.root / "checkpoints.json"
        if not path.exists():
            return {}
        return {int(step): int(epoch) for step, epoch in json.loads(path.read_text()).items()}

    def note_checkpoint(self, step: int, epoch: int) -> None:
        """Record that checkpoint `step` was saved during `epoch` (before it is saved)."""
        epochs = self._checkpoint_epochs() | {int(step): int(epoch)}
        self._write_json(self.root / "checkpoints.json", {str(s): e for s, e in epochs.items()})

    def collect_garbage(self, listed_steps: list[int], current_epoch: int) -> None:
        """Delete the files of epochs older than every kept checkpoint and the current one.

        `listed_steps`: the finished checkpoints on disk. A noted step above all of them is
        still being written (saves are asynchronous) and is kept; a noted step below the
        newest listed one and not listed was deleted (Orbax drops the oldest first).
        """
        epochs = self._checkpoint_epochs()
        newest = max(listed_steps, default=-1)
        kept = {s: e for s, e in epochs.items() if s in listed_steps or s > newest}
        oldest = min([current_epoch, *kept.values()])
        for path in self.root.glob("epoch_*.npy"):
            if int(path.name.split(".")[0].removeprefix("epoch_")) < oldest:
                path.unlink(missing_ok=True)
        if kept != epochs:
            self._write_json(self.root / "checkpoints.json", {str(s): e for s, e in kept.items()})
