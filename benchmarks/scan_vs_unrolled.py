"""Train-step time of the tiny Mixtral with its layers scanned vs Python-unrolled.

Both runs use jaxmoe's real train step (train_throughput.JaxRunner) on one CPU device; their
blocks of timed steps alternate, so a drifting load on a shared machine hits both alike.
Reported: median step time of each and scanned / unrolled.

    python benchmarks/scan_vs_unrolled.py [--variant top2] [--steps 20] [--blocks 4]
        [--set model.remat=full ...]
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_throughput import VARIANTS, JaxRunner, measure, variant_config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="top2", choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compile + warm)")
    parser.add_argument("--blocks", type=int, default=4, help="alternations of the layouts")
    parser.add_argument("--set", action="append", default=[], help="config override k=v")
    args = parser.parse_args(argv)
    runners = {
        layout: JaxRunner(
            variant_config(args.variant, [*args.set, f"model.scan_layers={layout == 'scanned'}"]),
            num_batches=4,
        )
        for layout in ("unrolled", "scanned")
    }
    times = measure(runners, args.warmup, args.steps, args.blocks)
    medians = {layout: statistics.median(t) for layout, t in times.items()}
    result = {
        "variant": args.variant,
        "overrides": args.set,
        "median_step_s": medians,
        "scanned_over_unrolled": medians["scanned"] / medians["unrolled"],
        "steps": {layout: len(t) for layout, t in times.items()},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
