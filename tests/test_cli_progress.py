"""Long commands (compile, convert, export, prepare) say at once what they do, and then how
long they have been at it, at a terminal; piped, they print only their result."""

import io
import json
import os
import pty
import subprocess
import sys
import threading
import time
from pathlib import Path

from jaxmoe.cli import _doing, build_parser
from jaxmoe.cli.progress import announced

ROOT = Path(__file__).resolve().parents[1]


class Terminal(io.StringIO):
    """A stream that says it is a terminal and signals each line that starts a beat."""

    def __init__(self):
        super().__init__()
        self.beat = threading.Event()

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if "still" in text:
            self.beat.set()
        return super().write(text)


def test_announced_says_what_runs_then_beats_until_it_ends():
    terminal = Terminal()
    with announced("convert", "converting a into b", stream=terminal, beat_s=0.01):
        assert terminal.getvalue() == "jaxmoe convert: converting a into b ...\n"
        assert terminal.beat.wait(60)
    lines = terminal.getvalue().splitlines()
    assert lines[1].startswith("jaxmoe convert: still converting a into b (")
    after = terminal.getvalue()
    time.sleep(0.05)
    assert terminal.getvalue() == after  # the beat thread was joined: no line after the end


def test_nothing_off_a_terminal_or_for_quick_commands():
    piped = io.StringIO()
    with announced("convert", "converting a into b", stream=piped, beat_s=0.01):
        pass
    with announced("eval", None, stream=Terminal()):
        pass
    assert piped.getvalue() == ""


def test_every_long_command_is_described():
    parser = build_parser()
    cases = {
        ("compile", "--config", "c.py", "--topology", "v5p-8"): "for v5p-8",
        ("convert", "t5x", "src", "dst"): "into",
        ("convert", "gqa", "src", "dst", "--num_kv_heads", "1"): "into",
        ("export", "hf", "ckpt", "dst"): "as hf into",
        ("export", "t5x", "ckpt", "out"): "as t5x into",
        ("prepare",): "configs/default.py",
    }
    for argv, part in cases.items():
        assert part in _doing(parser.parse_args(list(argv))), argv
    assert _doing(parser.parse_args(["eval", "--checkpoint", "c", "--data", "embedded"])) is None


def test_convert_at_a_terminal_announces_itself_before_its_result(tmp_path):
    """Through a pseudo-terminal, as a user sees it: the line on stderr, the result alone
    on stdout."""
    primary, secondary = pty.openpty()
    dst = tmp_path / "t5"
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxmoe", "convert", "t5x",
         str(ROOT / "tests/data/t5x_tiny/checkpoint_0"), str(dst)],
        stdout=subprocess.PIPE, stderr=secondary, cwd=ROOT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    os.close(secondary)
    first = b""
    while not first.endswith(b"\n"):
        first += os.read(primary, 1)
    assert first.decode().strip() == f"jaxmoe convert: converting {ROOT}/tests/data/t5x_tiny/" + (
        f"checkpoint_0 into {dst} ..."
    )
    out, _ = process.communicate(timeout=600)
    os.close(primary)
    assert process.returncode == 0
    assert json.loads(out)["checkpoint"] == str(dst)
