"""Temporary files beside their final name, and the leftovers of killed writers.

A cache file (a token stream, a trained tokenizer) is written under a hidden temporary name
in its own folder and renamed into place when whole, so a reader sees all of it or nothing.
An error, Ctrl-C or SIGTERM removes the temporary file on the way out; SIGKILL cannot, so
each temporary name carries the writer's host and pid (`.tmp-<host>.<pid>-...`), and the
next writer in that folder removes the ones whose process on this host is gone. A live
writer's files (on this host or another sharing the folder) are never touched.
"""

import logging
import os
import re
import socket
import tempfile

log = logging.getLogger(__name__)

PREFIX = ".tmp-"
_OWNER = re.compile(r"^\.tmp-(?P<host>[^/]+)\.(?P<pid>\d+)-")


def _host() -> str:
    return socket.gethostname().replace("/", "_")


def make_temporary(folder: str, suffix: str = "") -> tuple[int, str]:
    """(fd, path) of a new private file in `folder` named as this process's temporary."""
    return tempfile.mkstemp(dir=folder, prefix=f"{PREFIX}{_host()}.{os.getpid()}-", suffix=suffix)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


def remove_dead_temporaries(folder: str) -> None:
    """Remove the temporary files in `folder` left by killed processes of this host."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    host = _host()
    for name in names:
        owner = _OWNER.match(name)
        if not owner or owner["host"] != host or not _gone(int(owner["pid"])):
            continue
        path = os.path.join(folder, name)
        try:
            os.remove(path)
        except OSError:
            continue  # another writer removed it first, or it is not a file
        log.warning("removed %s, left by a killed process (pid %s)", path, owner["pid"])


def write_atomically(path: str, data: bytes) -> None:
    """Writes a file so that readers see either nothing or all of it, even with racing
    writers: a private temporary file in the same folder, then an atomic rename."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    remove_dead_temporaries(folder)
    fd, tmp = make_temporary(folder, suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a cache may be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
