"""Background writers' reports of a failure that jaxmoe already reports in one line.

Orbax writes a checkpoint on threads of its own (one per item writer, one that writes the
metadata once the items commit) and logs every exception such a thread ends with, traceback
and all, through absl, before handing it to the thread that waits for the save. Two kinds
of such failures reach the user as jaxmoe's one line from the main thread, so the threads'
reports of them only bury that line under a hundred others:

- a jaxmoe error (`ConfigError`, `CheckpointError`) raised by jaxmoe's own code on a writer
  thread: a converter's tensors are produced while Orbax writes them (checkpoints/
  leafwise.py), so a NaN or an integer tensor is found there;
- whatever the writers meet in an output that was abandoned (`abandon(path)`: a
  conversion that failed or was interrupted removes its staging folder while the writers
  still have files in flight; they find their files gone).

`quiet_background_errors()` drops exactly those absl records and thread reports; any
other error of a background thread still prints.
"""

import contextlib
import logging
import os
import sys
import threading

from jaxmoe.errors import CheckpointError, ConfigError

_abandoned: set[str] = set()  # outputs given up: what their writers meet now is aftermath


def abandon(path: str | os.PathLike) -> None:
    """Declare the output under `path` given up (called before it is removed)."""
    _abandoned.add(os.fspath(path))


def _mentions_abandoned(text: str) -> bool:
    return any(path in text for path in _abandoned)


def already_reported(error: BaseException | None, message: str = "") -> bool:
    """Whether a background thread's `error` (logged with `message`) is one the main
    thread reports itself, or the aftermath of an abandoned output."""
    if isinstance(error, ConfigError | CheckpointError):
        return True
    if not _abandoned:
        return False
    if error is not None and _mentions_abandoned(str(error)):
        return True
    # An interpreter exiting with jaxmoe's line while a writer still schedules work.
    shutdown = "cannot schedule new futures after interpreter shutdown"
    return _mentions_abandoned(message) or (error is not None and str(error) == shutdown)


class _DropReported(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or threading.current_thread() is threading.main_thread():
            return True
        error = record.exc_info[1] if record.exc_info else None
        return not already_reported(error, record.getMessage())


def hook_without(hook, error_of, dropped, marker: str):
    """`hook` (sys.unraisablehook or threading.excepthook) minus the reports whose error
    (`error_of(report)`) `dropped` accepts; wrapping again under one `marker` is a no-op."""
    if getattr(hook, marker, False):
        return hook

    def filtered(report):
        if dropped(error_of(report)):
            return
        hook(report)

    setattr(filtered, marker, True)
    return filtered


_FILTER = _DropReported()


@contextlib.contextmanager
def quiet_background_errors():
    """Within and after (writer threads report after the failed call has returned): absl
    drops background threads' records of errors jaxmoe reports itself, and the thread and
    unraisable hooks drop them too."""
    logging.getLogger("absl").addFilter(_FILTER)  # once: addFilter skips a repeat
    marker = "drops_reported"
    threading.excepthook = hook_without(
        threading.excepthook, lambda a: a.exc_value, already_reported, marker
    )
    sys.unraisablehook = hook_without(
        sys.unraisablehook, lambda u: u.exc_value, already_reported, marker
    )
    yield
