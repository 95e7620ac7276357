"""A benchmark worker process: one system's steps, driven over stdin/stdout.

The parent sends one command per line (`steps N`, `stop`); the worker answers each with one
JSON line. Each system lives in its own process, so a peer's threads (PyTorch's OpenMP
pool, XLA's) never share an interpreter with the other's, and neither imports the other.
"""

import json
import os
import subprocess
import sys


def serve(runner, ready: dict) -> None:
    """Worker side: announce `ready`, then run commands until `stop`."""
    print(json.dumps({"ready": True, **ready}), flush=True)
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "steps":
            times = [runner.step() for _ in range(int(argument))]
            print(json.dumps({"times": times}), flush=True)
        elif command == "stop":
            # Proof of separation: which frameworks this process ended up importing.
            loaded = sorted(m for m in ("jax", "jaxmoe", "torch") if m in sys.modules)
            print(json.dumps({"stopped": True, "imported": loaded, **runner.final()}), flush=True)
            return
        else:
            print(json.dumps({"error": f"unknown command {line.strip()!r}"}), flush=True)


class Worker:
    """Parent side: a running worker process."""

    def __init__(self, argv: list[str], env: dict | None = None, python: str | None = None):
        self.process = subprocess.Popen(
            [python or sys.executable, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise RuntimeError(f"benchmark worker {self.process.args[1:3]} exited ({code})")
        return json.loads(line)

    def steps(self, count: int) -> list[float]:
        self.process.stdin.write(f"steps {count}\n")
        self.process.stdin.flush()
        return self._read()["times"]

    def stop(self) -> dict:
        self.process.stdin.write("stop\n")
        self.process.stdin.flush()
        final = self._read()
        self.process.wait(timeout=60)
        return final


def is_quiet(loads: list[float], own_threads: int) -> bool:
    """Whether a run saw at most half the cores of load from other processes: before it
    (`loads[0]`), and during it on top of its own busy threads (the 1-minute load average
    counts those too)."""
    cores = os.cpu_count() or 1
    return loads[0] <= cores / 2 and max(loads) <= cores / 2 + own_threads


NOT_QUIET = (
    "WARNING: NOT A QUIET RUN: other processes loaded more than half the cores; these "
    "ratios are not comparable (quote quiet runs only)"
)


def report(result: dict, as_json: bool, print_table) -> None:
    """One JSON object (the quiet flag also as a warning on stderr) or the table."""
    if not as_json:
        print_table(result)
        return
    if not result["quiet"]:
        print(NOT_QUIET, file=sys.stderr)
    print(json.dumps(result))
