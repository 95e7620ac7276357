"""Running a benchmark's worker in its own process, and judging whether the host was quiet.

A worker is a module of this package run as `python -m benchmarks.NAME` from the
repository root, under this interpreter or another one (MaxText's venv, which has its own
JAX): `-m` puts the working directory on the worker's path, so the package is found
without installing it and without the caller's PYTHONPATH. Standard library only.
"""

import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.worker_protocol import Worker, json_lines

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MAXTEXT_VENV = os.environ.get("MAXTEXT_VENV", "~/.cache/maxtext_venv")
NOT_QUIET = (
    "WARNING: NOT A QUIET RUN: other processes loaded more than half the cores; these "
    "ratios are not comparable (quote quiet runs only)"
)


def worker_command(module: str, argv: list[str], python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", f"benchmarks.{module}", *argv]


def start_worker(module: str, argv: list[str], env=None, python=None) -> Worker:
    """A served worker (worker_protocol.serve), started and ready."""
    return Worker(worker_command(module, argv, python), env=env, cwd=ROOT)


def run_worker(module: str, argv: list[str], env=None, python=None) -> list[dict]:
    """Run a one-shot worker (worker_protocol.emit) to its end; its JSON lines."""
    command = worker_command(module, argv, python)
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode:
        tail = result.stderr.strip().splitlines()[-1:]
        raise RuntimeError(f"benchmarks.{module} exited {result.returncode}: {tail}")
    return json_lines(result.stdout)


def timed_blocks(workers: dict, steps: int, blocks: int, loads: list[float]) -> dict:
    """Warmed-up served workers take turns running `steps // blocks` steps, `blocks` times,
    so a drifting load hits them alike. Per worker: every step time ("times") and each
    block's median ("block_medians"); the load average after each round joins `loads`."""
    times = {name: [] for name in workers}
    block_medians = {name: [] for name in workers}
    per_block = max(steps // blocks, 1)
    for _ in range(blocks):
        for name, worker in workers.items():
            block = worker.steps(per_block)
            times[name] += block
            block_medians[name].append(statistics.median(block))
        loads.append(load_average())
    return {"times": times, "block_medians": block_medians}


def venv_python(venv: str | Path) -> Path | None:
    """The interpreter of a virtual environment, or None where there is none."""
    python = Path(venv).expanduser() / "bin" / "python"
    return python if python.exists() else None


def maxtext_env() -> dict:
    """A MaxText worker's environment: its venv's packages only, one CPU device."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "force_host_platform_device_count" not in f)
    return env


def load_average() -> float:
    return os.getloadavg()[0]


def is_quiet(loads: list[float], own_threads: int) -> bool:
    """Whether a run saw at most half the cores of load from other processes: before it
    (`loads[0]`), and during it on top of its own busy threads (the 1-minute load average
    counts those too)."""
    cores = os.cpu_count() or 1
    return loads[0] <= cores / 2 and max(loads) <= cores / 2 + own_threads
