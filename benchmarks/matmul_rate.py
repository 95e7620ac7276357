"""f32 matmul GFLOP/s of XLA:CPU and PyTorch at the shapes of the fine-grained training step.

What a CPU step can reach is bounded by how fast its matrix products run. This measures the
products the :fine_grained variant of train_throughput is made of (64 experts of FFN 128 on
d_model 256; 2048 tokens, 256 rows per expert) and one large product for the host's
practical peak, each as XLA compiles it (`jax.jit(a @ b)`) and as PyTorch runs it, so the
train_throughput ratio can be read against the host: a target ratio that would need the
whole step to run faster than its own matmuls is out of reach on that host.

Each system runs in its own worker process (`--worker jax|torch`, never importing the
other), one after the other, with the host's cores as threads; each shape is timed over
repeats totalling about 2e10 FLOPs after one warm-up call.

    python -m benchmarks matmul_rate            # table
    python -m benchmarks matmul_rate --json     # + docs/results/YYYY-MM-DD-matmul_rate.json
"""

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.peer_harness import ROOT, is_quiet, load_average
from benchmarks.results import add_json_flag, markdown_table, publish

# name -> (M, K, N) of an [M, K] x [K, N] product.
SHAPES = {
    "expert up/gate (256 rows, 256 -> 128)": (256, 256, 128),
    "expert down (256 rows, 128 -> 256)": (256, 128, 256),
    "dense projection (2048 tokens, 256 -> 256)": (2048, 256, 256),
    "output layer (2048 tokens, 256 -> 8192)": (2048, 256, 8192),
    "large (2048^3): the host's practical peak": (2048, 2048, 2048),
}
FLOPS_PER_SHAPE = 2e10


def _rates(run, make) -> dict:
    rates = {}
    for name, (m, k, n) in SHAPES.items():
        a, b = make(m, k), make(k, n)
        run(a, b)  # compile / warm up
        repeats = max(3, int(FLOPS_PER_SHAPE / (2 * m * k * n)))
        start = time.perf_counter()
        for _ in range(repeats):
            out = run(a, b)
        run.sync(out)
        seconds = (time.perf_counter() - start) / repeats
        rates[name] = 2 * m * k * n / seconds / 1e9
    return rates


def jax_worker() -> dict:
    import jax
    import jax.numpy as jnp

    product = jax.jit(lambda a, b: a @ b)

    def run(a, b):
        return product(a, b)

    run.sync = lambda out: out.block_until_ready()
    return _rates(run, lambda r, c: jnp.ones((r, c), jnp.float32) * 0.5)


def torch_worker() -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)

    def run(a, b):
        return a @ b

    run.sync = lambda out: None  # CPU tensors are computed when returned
    return _rates(run, lambda r, c: torch.full((r, c), 0.5))


def measure(system: str) -> dict:
    command = [sys.executable, "-m", "benchmarks.matmul_rate", "--worker", system]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(jax_worker() if args.worker == "jax" else torch_worker()))
        return 0
    loads = [load_average()]
    xla = measure("jax")
    loads.append(load_average())
    torch_rates = measure("torch")
    loads.append(load_average())
    rows = [[name, xla[name], torch_rates[name], xla[name] / torch_rates[name]] for name in SHAPES]
    table = markdown_table(["product", "XLA GFLOP/s", "PyTorch GFLOP/s", "XLA / PyTorch"], rows)
    result = {
        "gflops": {"xla": xla, "torch": torch_rates},
        "shapes": {name: list(shape) for name, shape in SHAPES.items()},
        "load_average_1min": loads,
        "quiet": is_quiet(loads, os.cpu_count() or 1),
    }
    publish("matmul_rate", result, table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
