"""How long the training loop waits for data per step: on the training thread, with the
prefetch thread, and with grain worker processes.

Builds the data of a config (default: configs/default.py, the embedded corpus) and runs the
trainer's data side alone: take a batch, then sleep for --step_ms, standing in for the device
step during which the trainer waits with the GIL released. Reports the mean time spent in
`next(batches)` per step (the median over --repeats rounds) and its share of the step
(wait / (wait + step)) for each objective (`lm`: packed windows, `t5`: span corruption) and
setting: data.prefetch = 0 (batches built on the training thread), the config's prefetch
depth on a thread (data.workers = 0), and each worker count of --workers (data.workers = N,
the same depth per worker).

    python -m benchmarks data_wait --step_ms 10                                  # LM
    python -m benchmarks data_wait --step_ms 10 --config.model.arch=encoder_decoder  # T5
    python -m benchmarks data_wait --step_ms 2 --objectives lm,t5 --workers 0,1,2 \\
        --repeats 3 --config.train.batch_size=32 --config.train.seq_len=512 --json  # docs/data.md

Host-to-device copies are not included (they are the same for every setting). Worker
start-up (spawning processes that import grain and jax) is excluded: the clock starts after
enough warm-up steps for every worker to have filled its buffer once.
"""

import argparse
import time
from pathlib import Path

import numpy as np

from benchmarks.results import add_json_flag, markdown_table, publish
from jaxmoe.config.loading import load_config
from jaxmoe.data.pipeline import build_data

ROOT = Path(__file__).resolve().parents[1]
ARCHS = {"lm": "decoder", "t5": "encoder_decoder"}


def mean_wait_s(config, steps: int, step_s: float) -> float:
    """Mean seconds per step spent in next(batches), after the warm-up steps."""
    batches = build_data(config.data, config.train, spans=config.span_corruption).train
    workers = config.data.workers
    for _ in range(3 + workers * max(config.data.prefetch, 1)):
        next(batches)
        time.sleep(step_s)
    waited = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        next(batches)
        waited += time.perf_counter() - start
        time.sleep(step_s)
    if hasattr(batches, "close"):
        batches.close()
    return waited / steps


def settings(depth: int, workers: list[int]) -> list[tuple[int, int]]:
    """(data.prefetch, data.workers) pairs: workers 0 gives the training thread and the
    prefetch thread, every other count its own processes."""
    out = []
    for count in workers:
        out += [(0, 0), (depth, 0)] if count == 0 else [(depth, count)]
    return out


def int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected counts >= 0 like 0,1,2")
    return values


def objective_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [name for name in names if name not in ARCHS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown objective {unknown[0]!r}: lm or t5")
    return names


def main(argv=None) -> list[dict]:
    """One row per (objective, prefetch, workers): wait_s and share of the step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.py"))
    parser.add_argument("--step_ms", type=float, default=10.0, help="simulated device step")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1, help="rounds; the median is kept")
    parser.add_argument(
        "--objectives", type=objective_list, default=None, help="lm,t5 (default: the config's)"
    )
    parser.add_argument(
        "--workers", type=int_list, default=[0], help="data.workers counts, e.g. 0,1,2"
    )
    add_json_flag(parser)
    args, overrides = parser.parse_known_args(argv)
    config = load_config(args.config, overrides)
    objectives = args.objectives or [
        "t5" if config.model.arch == ARCHS["t5"] else "lm",
    ]
    depth = config.data.prefetch or 2
    runs = [(o, p, w) for o in objectives for p, w in settings(depth, args.workers)]
    waits = {run: [] for run in runs}
    for _ in range(args.repeats):  # rounds interleave the settings: load drifts alike
        for objective, prefetch, workers in runs:
            run = config.replace(
                model=config.model.replace(arch=ARCHS[objective]),
                data=config.data.replace(prefetch=prefetch, workers=workers),
            )
            waits[objective, prefetch, workers].append(
                mean_wait_s(run, args.steps, args.step_ms / 1e3)
            )
    rows = []
    for (objective, prefetch, workers), measured in waits.items():
        wait = float(np.median(measured))
        share = wait / (wait + args.step_ms / 1e3)
        rows.append(
            {
                "objective": objective,
                "prefetch": prefetch,
                "workers": workers,
                "wait_s": wait,
                "share": share,
                "waits_s": measured,
            }
        )
        print(
            f"{objective}: data.prefetch={prefetch} data.workers={workers}: waits "
            f"{wait * 1e3:.3f} ms per step = {share:.1%} of a {args.step_ms:g} ms step "
            f"(B={config.train.batch_size}, L={config.train.seq_len}; median of "
            f"{len(measured)})",
            flush=True,
        )
    header = ["objective", "data.prefetch", "data.workers", "wait ms / step", "share"]
    cells = [
        [
            r["objective"],
            r["prefetch"],
            r["workers"],
            f"{r['wait_s'] * 1e3:.3f}",
            f"{r['share']:.1%}",
        ]
        for r in rows
    ]
    table = markdown_table(header, cells)
    saved = {
        "config": args.config,
        "overrides": overrides,
        "step_ms": args.step_ms,
        "steps": args.steps,
        "repeats": args.repeats,
        "batch_size": config.train.batch_size,
        "seq_len": config.train.seq_len,
        "rows": rows,
    }
    publish("data_wait", saved, table, args.json)
    return rows


if __name__ == "__main__":
    main()
