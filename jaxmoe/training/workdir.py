"""The training workdir: writable before anything compiles, and used by one run at a time.

Two trainers on one workdir would interleave their metrics and race on checkpoint steps,
so process 0 of a run holds `WORKDIR/.lock` (JSON: host, pid, process start, run start,
heartbeat) for as long as it trains. A lock left by a killed run is taken over: on the same
host when its process is gone, elsewhere when its heartbeat is older than `stale_after_s`.
A lock file that no jaxmoe run wrote (not a JSON object with those fields, of their types,
times finite) is a dead run's torn write or someone's edit: taken over with a warning that
says why. A heartbeat in the future (a host whose clock runs ahead) is never stale: the
refusal says so, and that removing the lock file frees the workdir.
"""

import json
import logging
import math
import os
import socket
import time

from etils import epath

from jaxmoe.errors import ConfigError
from jaxmoe.storage.paths import is_remote
from jaxmoe.storage.received import read_text

log = logging.getLogger("jaxmoe")

LOCK_NAME = ".lock"
HEARTBEAT_EVERY_S = 60.0
STALE_AFTER_S = 600.0  # another host's lock without a heartbeat for this long is dead
CLOCK_SLACK_S = 60.0  # a heartbeat further ahead than this comes from a clock that runs ahead


def parse_lock(text: str) -> tuple[dict | None, str]:
    """(record, "") of a lock file's text as a jaxmoe run writes it, or (None, why not)."""
    try:
        record = json.loads(text)
    except ValueError:
        return None, "not JSON (a torn write?)"
    if not isinstance(record, dict):
        return None, f"not a JSON object: {text.strip()[:40]!r}"
    if not isinstance(record.get("host"), str):
        return None, f"host={record.get('host')!r} is not a host name"
    pid = record.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid < 1:
        return None, f"pid={pid!r} is not a process id"
    for key in ("started", "heartbeat"):
        value = record.get(key)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            return None, f"{key}={value!r} is not a time"
    return record, ""


def check_workdir(workdir: str) -> epath.Path:
    """The workdir (absolute or remote: `train` makes it so) as a path, created if needed;
    fails before any compile if it cannot be written."""
    path = epath.Path(workdir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_probe_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"--workdir {workdir!r} is not writable: {error}") from error
    return path


def _process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (tells a reused pid apart), or None."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # The command name (field 2) may hold spaces; fields after it are fixed.
            return int(stat.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, start_ticks: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now_ticks = _process_start_ticks(pid)
    return start_ticks is None or now_ticks is None or now_ticks == start_ticks


class WorkdirInUse(ConfigError):
    pass


class WorkdirLock:
    """`with WorkdirLock(path):` holds the workdir for this run (process 0 only)."""

    def __init__(self, workdir: epath.Path, enabled: bool = True, stale_after_s=STALE_AFTER_S):
        self.path = workdir / LOCK_NAME
        self.enabled = enabled
        self.stale_after_s = stale_after_s
        self._record = None
        self._last_beat = 0.0

    def _describe(self, record: dict) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["started"]))
        ahead = record["heartbeat"] - time.time()
        future = (
            f"; its heartbeat is {ahead:.0f} s in the future: that host's clock runs ahead"
            if ahead > CLOCK_SLACK_S
            else ""
        )
        return f"host {record['host']}, pid {record['pid']}, started {started}{future}"

    def _read(self) -> tuple[dict | None, str]:
        """(record, "") of the lock file; (None, "") when there is none; (None, why) when
        it holds something no live run wrote, which is then taken over."""
        if self.path.is_dir():
            raise ConfigError(
                f"{self.path} is a directory, not the lock file jaxmoe keeps there: remove it "
                f"to use workdir {str(self.path.parent)!r}"
            )
        try:
            if is_remote(str(self.path)):
                text = self.path.read_text()
            else:  # a FIFO or a device there would block or never end
                text = read_text(str(self.path), "lock file", limit=1 << 20)
        except FileNotFoundError:
            return None, ""
        except (OSError, ValueError) as error:
            return None, f"unreadable ({error})"
        return parse_lock(text)

    def _is_stale(self, record: dict) -> bool:
        if record["host"] == socket.gethostname():
            start_ticks = record.get("pid_start")
            return not _alive(record["pid"], start_ticks if isinstance(start_ticks, int) else None)
        return time.time() - record["heartbeat"] > self.stale_after_s

    def _write_new(self, exclusive: bool) -> None:
        text = json.dumps(self._record)
        if exclusive and not is_remote(str(self.path)):
            # O_EXCL: of two runs starting together exactly one creates the file.
            fd = os.open(str(self.path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            return
        temporary = self.path.parent / f"{LOCK_NAME}.{os.getpid()}.tmp"
        temporary.write_text(text)
        temporary.replace(self.path)

    def acquire(self) -> None:
        if not self.enabled:
            return
        now = time.time()
        self._record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _process_start_ticks(os.getpid()),
            "started": now,
            "heartbeat": now,
        }
        existing, garbage = self._read()
        if existing is None and not garbage:
            try:
                self._write_new(exclusive=True)
            except FileExistsError:
                existing, garbage = self._read()
        if existing is not None or garbage:
            if existing is not None and not self._is_stale(existing):
                raise WorkdirInUse(
                    f"workdir {str(self.path.parent)!r} is in use by another jaxmoe train "
                    f"({self._describe(existing)}); wait for it, stop it, or pick another "
                    f"--workdir (if no run uses it, remove {self.path})"
                )
            log.warning(
                "workdir %s: taking over the lock of a run that is gone (%s)",
                self.path.parent,
                self._describe(existing) if existing else f"{self.path}: {garbage}",
            )
            self._write_new(exclusive=False)
        # Two runs taking over one stale lock together: the last rename wins; the loser
        # sees someone else's record here and stops before touching anything.
        current, _ = self._read()
        if current != self._record:
            holder = self._describe(current) if current else "unknown"
            raise WorkdirInUse(
                f"workdir {str(self.path.parent)!r} was taken by another jaxmoe train "
                f"({holder}) while this one started"
            )
        self._last_beat = now

    def heartbeat(self) -> None:
        """Refresh the lock's heartbeat (cheap: at most one small write a minute)."""
        if not self.enabled or self._record is None:
            return
        now = time.time()
        if now - self._last_beat < HEARTBEAT_EVERY_S:
            return
        self._record["heartbeat"] = now
        self._last_beat = now
        try:
            self._write_new(exclusive=False)
        except OSError as error:  # a full disk must not kill training; the next beat retries
            log.warning("workdir lock heartbeat failed: %s", error)

    def release(self) -> None:
        if not self.enabled or self._record is None:
            return
        if self._read()[0] == self._record:
            self.path.unlink(missing_ok=True)
        self._record = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
