"""What glibc's handling of freed memory costs a CPU training step, in jaxmoe and in PyTorch.

Each case runs in its own process: jaxmoe's top-2 step of configs/tiny_mixtral.py with
jaxmoe's allocator settings (jaxmoe/parallel/host_memory.py, what `jaxmoe train` applies on
the CPU) and with glibc's defaults (JAXMOE_HOST_MALLOC=default), and Hugging Face's Mixtral
step with glibc's defaults and with the same four settings given as MALLOC_* environment
variables. Per step: wall time, user and kernel CPU time and minor page faults
(getrusage), medians over rounds that alternate the cases.

    python -m benchmarks host_malloc [--steps 10] [--rounds 2] [--json]
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

from benchmarks.peer_harness import is_quiet, load_average, run_worker
from benchmarks.results import add_json_flag, markdown_table, publish
from benchmarks.worker_protocol import emit

# glibc's environment names for the settings jaxmoe applies with mallopt.
GLIBC_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1),
    "MALLOC_TOP_PAD_": str(64 * 2**20),
}
CASES = {
    "jaxmoe, retained (its default)": ("jaxmoe", {}),
    "jaxmoe, glibc defaults": ("jaxmoe", {"JAXMOE_HOST_MALLOC": "default"}),
    "hf, glibc defaults": ("hf", {}),
    "hf, retained (MALLOC_* env)": ("hf", GLIBC_ENV),
}


def _runner(system: str):
    if system == "jaxmoe":
        from jaxmoe.parallel.host_memory import retain_freed_host_memory
        from jaxmoe.parallel.platforms import skip_absent_tpu

        skip_absent_tpu()
        applied = retain_freed_host_memory()  # before the backend starts, as the CLI does
        from benchmarks.throughput_jaxmoe import JaxRunner, variant_config

        return JaxRunner(variant_config("top2", []), 4), applied
    from benchmarks.throughput_hf import HFRunner

    spec = json.loads(os.environ["HOST_MALLOC_SPEC"])
    return HFRunner(spec, "top2", 4, threads=os.cpu_count() or 1), None


def worker(system: str, steps: int) -> None:
    runner, applied = _runner(system)
    for _ in range(3):  # compile, warm caches, grow the heap to its size
        runner.step()
    before = resource.getrusage(resource.RUSAGE_SELF)
    walls = [runner.step() for _ in range(steps)]
    after = resource.getrusage(resource.RUSAGE_SELF)
    emit(
        {
            "wall_ms": 1e3 * statistics.median(walls),
            "user_ms": 1e3 * (after.ru_utime - before.ru_utime) / steps,
            "sys_ms": 1e3 * (after.ru_stime - before.ru_stime) / steps,
            "faults": (after.ru_minflt - before.ru_minflt) / steps,
            "mallopt_applied": applied,
        }
    )


def spec_worker() -> None:
    from benchmarks.throughput_jaxmoe import peer_spec, variant_config

    emit(peer_spec(variant_config("top2", [])))


def peer_spec() -> str:
    """The peer's model as JSON, from a jaxmoe process (the HF worker never imports JAX)."""
    return json.dumps(run_worker("host_malloc", ["--worker", "spec"])[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    add_json_flag(parser)
    parser.add_argument("--worker", choices=("jaxmoe", "hf", "spec"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "spec":
        spec_worker()
        return 0
    if args.worker:
        worker(args.worker, args.steps)
        return 0
    spec = peer_spec()
    runs = {name: [] for name in CASES}
    loads = [load_average()]
    for _ in range(args.rounds):
        for name, (system, extra) in CASES.items():
            env = {**os.environ, "HOST_MALLOC_SPEC": spec, **extra}
            env.setdefault("JAX_PLATFORMS", "cpu")
            argv = ["--worker", system, "--steps", str(args.steps)]
            runs[name].append(run_worker("host_malloc", argv, env=env)[-1])
            loads.append(load_average())
            time.sleep(1)
    cases = {
        name: {
            key: statistics.median(r[key] for r in rows)
            for key in rows[0]
            if key != "mallopt_applied"
        }
        | {"mallopt_applied": rows[0]["mallopt_applied"]}
        for name, rows in runs.items()
    }
    result = {
        "cases": cases,
        "steps": args.steps,
        "rounds": args.rounds,
        "load_1min": loads,
        "quiet": is_quiet(loads, own_threads=os.cpu_count() or 1),
    }
    publish("host_malloc", result, table(result), args.json)
    return 0


def table(result: dict) -> str:
    rows = [
        [name, f"{c['wall_ms']:.1f}", f"{c['user_ms']:.1f}", f"{c['sys_ms']:.1f}",
         f"{c['faults']:.0f}"]
        for name, c in result["cases"].items()
    ]  # fmt: skip
    quiet = "quiet" if result["quiet"] else "NOT QUIET"
    loads = ", ".join(f"{x:.1f}" for x in result["load_1min"])
    header = ["case", "wall ms", "user ms", "sys ms", "faults"]
    return f"{markdown_table(header, rows)}\n\nload (1 min) {loads}: {quiet}"


if __name__ == "__main__":
    sys.exit(main())
