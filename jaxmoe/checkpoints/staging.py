"""Writing a new checkpoint directory atomically (convert hf / t5x / gqa / upcycle, export t5x).

The files are written into a hidden sibling of DST (same filesystem, so the final rename is
atomic) that is renamed onto DST only once complete: a crash or an error never leaves a
half-written DST, and the staging folder is removed on the way out either way. A DST that
exists is refused unless it is an empty directory (one made ahead of time, e.g. by a job
script), which the rename replaces.
"""

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from jaxmoe.checkpoints.manager import CheckpointError


def refuse_existing(dst: str | os.PathLike) -> Path:
    """`dst` made absolute; CheckpointError if it exists and is not an empty directory.
    Called before the slow work starts, so that a bad DST fails at once."""
    dst = Path(dst).absolute()
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"{dst}: already exists; converting writes a new directory")
    return dst


@contextlib.contextmanager
def staged_directory(dst: str | os.PathLike) -> Iterator[Path]:
    """Yields the path of the staging folder next to `dst` (not yet created: Orbax wants to
    make it itself); renames it to `dst` when the block ends without an exception."""
    dst = Path(dst).absolute()
    staging = dst.parent / f".{dst.name}.converting-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)  # left by an earlier run killed in between
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield staging
        if dst.exists():
            dst.rmdir()  # only an empty directory may be replaced: never a checkpoint
        staging.rename(dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
