"""A local working copy of a remote folder (gs://...), for files that must be local.

numpy memory-maps a file through the OS, so files that jaxmoe memory-maps or updates in
place (the curriculum store, token caches) live in a local folder; a `Mirror` copies them
to and from the remote folder at the points where they must be stored. Flat folders only.
"""

import os
import shutil

from etils import epath

_CHUNK = 1 << 24
TMP_MARK = ".tmp"  # files named with it are half written, never copied


def _copy(src: epath.Path, dst: epath.Path) -> None:
    with src.open("rb") as reader, dst.open("wb") as writer:
        shutil.copyfileobj(reader, writer, _CHUNK)


class Mirror:
    def __init__(self, remote: str, local: str):
        self.remote, self.local = epath.Path(remote), epath.Path(local)
        self._pushed: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) stored

    def pull(self, name: str) -> bool:
        """Copy remote file `name` into the local folder (atomically); False if absent."""
        src = self.remote / name
        if not src.exists():
            return False
        self.local.mkdir(parents=True, exist_ok=True)
        # Processes on one machine may share the local folder: each copies to its own name.
        tmp = self.local / f"{name}{TMP_MARK}-{os.getpid()}"
        try:
            _copy(src, tmp)
            os.replace(tmp, self.local / name)
        finally:
            tmp.unlink(missing_ok=True)
        self._pushed[name] = self._signature(name)
        return True

    def pull_all(self) -> None:
        if self.remote.exists():
            for child in self.remote.iterdir():
                if TMP_MARK not in child.name:
                    self.pull(child.name)

    def push(self, name: str) -> None:
        """Store local file `name` remotely (GCS replaces an object whole, atomically)."""
        self.remote.mkdir(parents=True, exist_ok=True)
        _copy(self.local / name, self.remote / name)
        self._pushed[name] = self._signature(name)

    def push_changed(self, updated_in_place: tuple[str, ...] = ()) -> None:
        """Store every local file replaced since it was last stored, and those named in
        `updated_in_place` (a write through a memmap may leave the size and mtime as they
        were); delete the remote files that are gone locally."""
        local = {p.name for p in self.local.iterdir() if TMP_MARK not in p.name}
        for name in sorted(local):
            if name in updated_in_place or self._pushed.get(name) != self._signature(name):
                self.push(name)
        for name in sorted(set(self._pushed) - local):
            (self.remote / name).unlink(missing_ok=True)
            del self._pushed[name]

    def _signature(self, name: str) -> tuple[int, int]:
        stat = os.stat(self.local / name)
        return stat.st_size, stat.st_mtime_ns
