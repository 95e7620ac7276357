"""How a benchmark talks to its worker processes: JSON lines on stdout.

Two shapes. A served worker (`serve`, driven by `Worker`) announces itself, then answers
one JSON line per command read from stdin (`steps N`, `stop`). A one-shot worker (`emit`)
prints one JSON line per case and exits; the parent collects them
(`peer_harness.run_worker`). Each system lives in its own process, so a peer's threads
(PyTorch's OpenMP pool, XLA's) never share an interpreter with the other's, and neither
imports the other. Standard library only: workers run under other interpreters too.
"""

import json
import subprocess
import sys

FRAMEWORKS = ("jax", "jaxmoe", "torch")


def imported_frameworks() -> list[str]:
    """Proof of separation: which frameworks this process ended up importing."""
    return sorted(m for m in FRAMEWORKS if m in sys.modules)


def emit(row: dict) -> None:
    """One-shot worker side: one result line (the parent keeps lines starting with '{')."""
    print(json.dumps(row), flush=True)


def serve(runner, ready: dict) -> None:
    """Served worker side: announce `ready`, then run commands until `stop`."""
    emit({"ready": True, **ready})
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "steps":
            emit({"times": [runner.step() for _ in range(int(argument))]})
        elif command == "stop":
            emit({"stopped": True, "imported": imported_frameworks(), **runner.final()})
            return
        else:
            emit({"error": f"unknown command {line.strip()!r}"})


def json_lines(text: str) -> list[dict]:
    """The JSON lines of a worker's stdout (anything else it printed is skipped)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


class Worker:
    """Parent side of a served worker: a running process (see peer_harness.start_worker)."""

    def __init__(self, command: list[str], env: dict | None = None, cwd=None):
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=cwd
        )
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise RuntimeError(f"benchmark worker {self.process.args[1:4]} exited ({code})")
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
