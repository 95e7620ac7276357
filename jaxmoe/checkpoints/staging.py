"""Writing a new checkpoint directory atomically (convert hf / t5x / gqa / upcycle, export).

The files are written into a hidden sibling of DST (same filesystem, so the final rename is
atomic) that is renamed onto DST only once complete: a crash or an error never leaves a
half-written DST, and the staging folder is removed on the way out either way, on Ctrl-C
(KeyboardInterrupt) and SIGTERM (turned into `Interrupted`, a KeyboardInterrupt) too. A DST
that exists is refused unless it is an empty directory (one made ahead of time, e.g. by a
job script), which the rename replaces.

A SIGKILL leaves the staging folder behind; the next conversion to the same DST removes it,
with a warning. A conversion holds an exclusive `flock` on `.<DST name>.lock` beside DST
while it writes, so a staging folder whose lock nobody holds is a dead run's (the kernel
drops the lock of a killed process; a pid could be reused, a lock cannot outlive its
owner), and a second conversion to a DST that is being written is refused at once instead
of racing the first to the rename.
"""

import contextlib
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.storage.background_errors import abandon, quiet_background_errors
from jaxmoe.storage.interrupts import signal_name, signals_held, terminate_as_interrupt

log = logging.getLogger(__name__)


def check_writable(path: str | os.PathLike) -> Path:
    """`path` made absolute; CheckpointError unless it is a directory that exists and is
    writable or one that can be made (its nearest existing ancestor is a writable
    directory). Called before any work: the write at the end would fail with a traceback."""
    path = Path(path).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        if existing == path:
            raise CheckpointError(f"{path}: is a file, not a directory")
        raise CheckpointError(f"{path}: cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"{path}: cannot be created: {existing} is not writable")
    return path


def check_new_directory(dst: str | os.PathLike) -> Path:
    """`dst` made absolute; CheckpointError unless a directory can be made (or renamed)
    there: an existing `dst` needs a writable parent, a new one a creatable path."""
    dst = Path(dst).absolute()
    check_writable(dst.parent if dst.exists() else dst)
    return dst


def refuse_existing(dst: str | os.PathLike) -> Path:
    """`dst` made absolute; CheckpointError if it exists and is not an empty directory, if
    its folder cannot be written, or if another conversion is writing it. Called before the
    slow work starts, so that a bad DST fails at once (leftovers of a killed run go now)."""
    dst = Path(dst).absolute()
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"{dst}: already exists; converting writes a new directory")
    check_new_directory(dst)
    if dst.parent.is_dir():
        with _claimed(dst):
            pass
    return dst


@contextlib.contextmanager
def staged_directory(dst: str | os.PathLike) -> Iterator[Path]:
    """Yields the path of the staging folder next to `dst` (not yet created: Orbax wants to
    make it itself); renames it to `dst` when the block ends without an exception."""
    dst = check_writable(Path(dst).absolute().parent) / Path(dst).name
    staging = dst.parent / f".{dst.name}.converting-{os.getpid()}"
    made = not dst.parent.exists()
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        with terminate_as_interrupt(), _claimed(dst), quiet_background_errors():
            try:
                yield staging
                if dst.exists():
                    dst.rmdir()  # only an empty directory may be replaced: never a checkpoint
                staging.rename(dst)
            except BaseException:
                # Orbax's writers may still have files in flight: what they meet in the
                # folder removed under them is not news (the error is reported once).
                abandon(staging)
                raise
            finally:
                with signals_held():  # a second Ctrl-C must not stop the cleanup half way
                    _remove_while_writers_finish(staging)
    except BaseException:
        if made:  # e.g. export t5x's OUT: not left behind, empty, by a failed export
            with contextlib.suppress(OSError):
                dst.parent.rmdir()
        raise


def _remove_while_writers_finish(staging: Path, settle_s: float = 0.2, limit_s: float = 30.0):
    """Removes `staging`, again while it reappears: an interrupt can land while Orbax's
    writer threads still have files in flight, and a file they finish after the first
    removal brings its folder back (seen as a leftover staging folder under load)."""
    deadline = time.monotonic() + limit_s
    while staging.exists() and time.monotonic() < deadline:  # renamed into place: gone
        shutil.rmtree(staging, ignore_errors=True)
        time.sleep(settle_s)


@contextlib.contextmanager
def interrupts_in_one_line(dst: str | os.PathLike) -> Iterator[None]:
    """For the CLI: SIGTERM and Ctrl-C end the block with a RuntimeError (the one-line
    error the CLI prints, exit 2) once staged_directory has removed its staging folder."""
    with terminate_as_interrupt():
        try:
            yield
        except KeyboardInterrupt as error:
            raise RuntimeError(
                f"interrupted by {signal_name(error)}; no partial checkpoint left at "
                f"{Path(dst).absolute()}"
            ) from None


@contextlib.contextmanager
def _claimed(dst: Path) -> Iterator[None]:
    """Holds DST's lock within the block, after removing staging folders of killed runs;
    CheckpointError if another live conversion holds it."""
    lock = dst.parent / f".{dst.name}.lock"
    fd = _try_lock(lock)
    if fd is None:
        owner = lock.read_text().strip() if lock.is_file() else "?"
        raise CheckpointError(
            f"{dst}: another conversion (pid {owner or '?'}) is writing it now; wait for it "
            "to finish or choose another DST"
        )
    try:
        _remove_leftovers(dst)
        yield
    finally:
        lock.unlink(missing_ok=True)  # before the lock is released: see _try_lock
        os.close(fd)


def _try_lock(lock: Path) -> int | None:
    """An fd holding an exclusive flock on `lock` (which then holds our pid), or None if
    another process holds it. The holder unlinks the file before it lets go, so a lock
    taken on a file that is no longer at `lock` is stale and taken again."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            current = os.stat(lock).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)


def _remove_leftovers(dst: Path) -> None:
    """Removes staging folders of conversions to `dst` that were killed (called holding the
    lock: no live conversion owns them)."""
    prefix = f".{dst.name}.converting-"
    for entry in dst.parent.iterdir():
        if entry.name.startswith(prefix) and entry.is_dir() and not entry.is_symlink():
            pid = entry.name.removeprefix(prefix)
            shutil.rmtree(entry, ignore_errors=True)
            log.warning(
                "removed %s, left by a conversion to %s that was killed (pid %s)", entry, dst, pid
            )
