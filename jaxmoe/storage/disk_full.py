"""A full disk under the workdir: one line for the user instead of hundreds.

When a write fails with ENOSPC, the error reaches `train` once, but every background writer
reports it too: Orbax's save threads log a traceback per item, TensorStore callbacks that
complete after the failed save find their asyncio loop closed, TensorBoard's writer thread
and its exit hook fail to flush. `quiet_disk_full()` drops exactly those secondary reports
(records and hooks whose error is ENOSPC, or that only occur after one) so that stderr holds
jaxmoe's own line; any other error still prints as before.
"""

import contextlib
import errno
import logging
import sys
import threading

from jaxmoe.storage.background_errors import hook_without

_seen = False  # a no-space error was seen in this process: its aftermath may be dropped


def no_space_left(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from, is ENOSPC. TensorStore (Orbax's
    writer) reports it as a ValueError carrying the OS error code in its text."""
    global _seen
    checked = set()
    while error is not None and id(error) not in checked:
        checked.add(id(error))
        text = str(error)
        if (
            (isinstance(error, OSError) and error.errno == errno.ENOSPC)
            or "No space left on device" in text
            or f"os_error_code='{errno.ENOSPC}'" in text
        ):
            _seen = True
            return True
        # `raise ... from None` hides the context: the error was already translated.
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return False


def _aftermath(error: BaseException | None) -> bool:
    """Secondary errors of a failed write: loops closed under pending callbacks, writer
    pipes closed under their threads."""
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    if not _seen:
        return False
    # Orbax's metadata thread, still committing the failed save while the process exits
    # with jaxmoe's one line, finds the executor shut down (seen once in a loaded CI lane).
    shutdown = "cannot schedule new futures after interpreter shutdown"
    return (isinstance(error, OSError) and str(error) == "handle is closed") or (
        isinstance(error, RuntimeError) and str(error) == shutdown
    )


class _DropNoSpace(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        return not (no_space_left(error) or no_space_left(Exception(message)) or _aftermath(error))


def _dropped(error: BaseException | None) -> bool:
    return no_space_left(error) or _aftermath(error)


_LOG_FILTER = _DropNoSpace()


@contextlib.contextmanager
def quiet_disk_full():
    """Within and after: background loggers drop ENOSPC records, and the hooks drop their
    aftermath. Both stay installed on exit: Orbax's save threads, TensorBoard's exit hook and
    abandoned callbacks report after the failed call has returned (seen under load)."""
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_LOG_FILTER)  # once: addFilter skips a repeat
    marker = "drops_disk_full"
    sys.unraisablehook = hook_without(sys.unraisablehook, lambda u: u.exc_value, _dropped, marker)
    threading.excepthook = hook_without(
        threading.excepthook, lambda a: a.exc_value, _dropped, marker
    )
    yield
