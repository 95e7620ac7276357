"""Progress of the commands that can work for minutes before they print anything (compile,
convert, export, prepare): at a terminal, a line at once saying what runs, then one every
BEAT_S seconds with the time so far, on stderr. Off a terminal (a pipe, a log, a test) the
commands print only their result or their one-line error, as scripts parse them."""

import contextlib
import sys
import threading
import time

BEAT_S = 30.0


@contextlib.contextmanager
def announced(command: str, doing: str | None, stream=None, beat_s: float = BEAT_S):
    """`jaxmoe COMMAND: DOING ...` now, `... still DOING (N s)` every `beat_s` seconds
    until the block ends; nothing when `doing` is None or `stream` (default: stderr) is not
    a terminal."""
    stream = sys.stderr if stream is None else stream
    if doing is None or not stream.isatty():
        yield
        return
    start = time.monotonic()
    print(f"jaxmoe {command}: {doing} ...", file=stream, flush=True)
    done = threading.Event()

    def beat():
        while not done.wait(beat_s):
            seconds = time.monotonic() - start
            print(f"jaxmoe {command}: still {doing} ({seconds:.0f} s)", file=stream, flush=True)

    thread = threading.Thread(target=beat, name="jaxmoe-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
