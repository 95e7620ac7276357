"""How long the training loop waits for data per step, with and without prefetching.

Builds the data of a config (default: configs/default.py, the embedded corpus) and runs the
trainer's data side alone: take a batch, then sleep for --step_ms, standing in for the device
step during which the trainer waits with the GIL released. Reports the mean time spent in
`next(batches)` per step and its share of the step (wait / (wait + step)), for
data.prefetch = 0 (batches built on the training thread) and the config's prefetch depth.

    python -m benchmarks data_wait --step_ms 10                                  # LM
    python -m benchmarks data_wait --step_ms 10 --config.model.arch=encoder_decoder  # T5

Host-to-device copies are not included (they are the same with or without prefetching).
"""

import argparse
import time
from pathlib import Path

from benchmarks.results import add_json_flag, markdown_table, publish
from jaxmoe.config.loading import load_config
from jaxmoe.data.pipeline import build_data

ROOT = Path(__file__).resolve().parents[1]


def mean_wait_s(config, steps: int, step_s: float) -> float:
    """Mean seconds per step spent in next(batches), after a few warm-up steps."""
    batches = build_data(config).train
    for _ in range(3):
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


def main(argv=None) -> dict:
    """{prefetch depth: (mean wait s, share of the step)}."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.py"))
    parser.add_argument("--step_ms", type=float, default=10.0, help="simulated device step")
    parser.add_argument("--steps", type=int, default=200)
    add_json_flag(parser)
    args, overrides = parser.parse_known_args(argv)
    config = load_config(args.config, overrides)
    depth = int(config.data.prefetch) or 2
    result = {}
    for prefetch in (0, depth):
        with config.unlocked():
            config.data.prefetch = prefetch
        wait = mean_wait_s(config, args.steps, args.step_ms / 1e3)
        share = wait / (wait + args.step_ms / 1e3)
        result[prefetch] = (wait, share)
        print(
            f"data.prefetch={prefetch}: waits {wait * 1e3:.3f} ms per step = {share:.1%} of a "
            f"{args.step_ms:g} ms step (B={config.train.batch_size}, L={config.train.seq_len}, "
            f"arch={config.model.arch})",
            flush=True,
        )
    rows = [[p, f"{w * 1e3:.3f}", f"{s:.1%}"] for p, (w, s) in result.items()]
    table = markdown_table(["data.prefetch", "wait ms / step", "share of the step"], rows)
    saved = {
        "config": args.config,
        "overrides": overrides,
        "step_ms": args.step_ms,
        "steps": args.steps,
        "rows": [{"prefetch": p, "wait_s": w, "share": s} for p, (w, s) in result.items()],
    }
    publish("data_wait", saved, table, args.json)
    return result


if __name__ == "__main__":
    main()
