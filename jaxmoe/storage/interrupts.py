"""SIGTERM handled like Ctrl-C, so that one cleanup path serves both.

Within `terminate_as_interrupt()` SIGTERM (a job scheduler stopping a command, `kill`)
raises `Interrupted`, a KeyboardInterrupt, where Ctrl-C raises KeyboardInterrupt: `finally`
blocks remove temporary files either way, and the command prints one line instead of
dying silently (SIGTERM's default) or with a traceback (Ctrl-C's). `signals_held()` defers
both signals while a cleanup must not be cut half way. Light: the CLI imports it before
any command runs.
"""

import contextlib
import signal
import threading
from collections.abc import Iterator


class Interrupted(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt so that the same cleanup runs;
    args[0] is the signal's name."""


def signal_name(interrupt: KeyboardInterrupt) -> str:
    """SIGTERM or SIGINT: which signal raised `interrupt`."""
    return interrupt.args[0] if isinstance(interrupt, Interrupted) and interrupt.args else "SIGINT"


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises `Interrupted` (in the main thread; elsewhere Python
    cannot take signals and the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends (then raise as usual)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
