"""What quiet_disk_full drops after a full disk, and what it still lets through."""

import logging

from jaxmoe.storage import disk_full

SHUTDOWN = "cannot schedule new futures after interpreter shutdown"


def _logged(error: BaseException) -> list[str]:
    """Messages the "absl" logger passes on for a logging.exception of `error`."""
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("absl")
    logger.addHandler(handler)
    try:
        with disk_full.quiet_disk_full():
            try:
                raise error
            except RuntimeError:
                logger.exception("_SignalingThread.run() raised an exception: %s", error)
    finally:
        logger.removeHandler(handler)
    return seen


def test_orbax_thread_at_shutdown_is_dropped_only_after_a_full_disk(monkeypatch):
    monkeypatch.setattr(disk_full, "_seen", False)
    assert len(_logged(RuntimeError(SHUTDOWN))) == 1  # no full disk: a real error, shown
    assert disk_full.no_space_left(OSError(28, "No space left on device"))
    assert _logged(RuntimeError(SHUTDOWN)) == []
    assert len(_logged(RuntimeError("something else"))) == 1
