"""Files received from others (checkpoints, tokenizers, Hugging Face folders), opened only
once they are what they claim to be: a regular file of a size such a file can have.

Confinement (checkpoints/safe_paths.py) keeps reads inside the folder a user named; this
keeps them finite. A FIFO named `tokenizer.model` blocks the reader forever, a device
(`/dev/zero`) never ends, and a sparse file claiming 20 GB is read whole into memory: each is
refused here, in one line naming the file, before anything reads it. `read_file` checks the
file it actually opened (non-blocking, then `fstat`), so a swap between the check and the
read cannot slip a FIFO in.
"""

import os
import stat

# A tokenizer's model file: Gemma 3's 262k-piece tokenizer.json is 33 MB.
TOKENIZER_LIMIT = 1 << 30
# A JSON side file (config.json, tokenizer_config.json, an index, a stored config).
JSON_LIMIT = 256 << 20

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_regular(mode: int) -> str | None:
    """What a file of `mode` is when it is not a regular file ("a FIFO (named pipe)"), or
    None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def _check(path, info: os.stat_result, what: str, limit: int | None) -> None:
    kind = not_regular(info.st_mode)
    if kind:
        raise ValueError(f"{path}: is {kind}, not a regular file ({what})")
    if limit is not None and info.st_size > limit:
        raise ValueError(
            f"{path}: {info.st_size:,} bytes, more than a {what} can hold ({limit:,}): not read"
        )


def check_file(path, what: str, limit: int | None = None) -> int:
    """The size of `path` (symlinks followed) after checking that it is a regular file of at
    most `limit` bytes; ValueError naming it and `what` it should be otherwise."""
    info = os.stat(path)
    _check(path, info, what, limit)
    return info.st_size


def read_file(path, what: str, limit: int) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes (else ValueError, and
    nothing read); FileNotFoundError as open() raises it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, unread
    try:
        _check(path, os.fstat(fd), what, limit)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read()
    finally:
        os.close(fd)


def read_text(path, what: str, limit: int = JSON_LIMIT) -> str:
    """`read_file` decoded as UTF-8 (ValueError if it is not)."""
    data = read_file(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})") from None
