"""Train-step time of the tiny Mixtral with its layers scanned vs Python-unrolled.

Both runs use jaxmoe's real train step (throughput_jaxmoe.JaxRunner) in this process on one
CPU device; their blocks of timed steps alternate, so a drifting load on a shared machine
hits both alike. Reported: median step time of each and scanned / unrolled.

    python -m benchmarks scan_vs_unrolled [--variant top2] [--steps 20] [--blocks 4]
        [--set model.remat=full ...] [--json]
"""

import argparse
import statistics
import sys

from benchmarks.results import add_json_flag, markdown_table, publish
from benchmarks.throughput_jaxmoe import JaxRunner, variant_config
from benchmarks.train_throughput import VARIANTS
from jaxmoe.parallel.host_memory import retain_freed_host_memory
from jaxmoe.parallel.platforms import skip_absent_tpu


def measure(runners: dict, warmup: int, steps: int, blocks: int) -> dict[str, list[float]]:
    """Each runner's step times: warm-up, then `blocks` alternating blocks of steps."""
    for runner in runners.values():
        for _ in range(warmup):
            runner.step()
    times = {name: [] for name in runners}
    for _ in range(blocks):
        for name, runner in runners.items():
            times[name] += [runner.step() for _ in range(max(steps // blocks, 1))]
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="top2", choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compile + warm)")
    parser.add_argument("--blocks", type=int, default=4, help="alternations of the layouts")
    parser.add_argument("--set", action="append", default=[], help="config override k=v")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    skip_absent_tpu()  # as the throughput worker: libtpu's probe without a TPU is noise
    retain_freed_host_memory()
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
    rows = [[layout, f"{s * 1e3:.1f}", result["steps"][layout]] for layout, s in medians.items()]
    table = markdown_table(["layout", "median ms/step", "steps"], rows)
    table += f"\n\nscanned / unrolled: {result['scanned_over_unrolled']:.3f}"
    publish("scan_vs_unrolled", result, table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
