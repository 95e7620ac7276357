"""The CPU train step under XLA:CPU's optional code paths, each in its own process.

XLA:CPU can hand dots and elementwise fusions to different libraries (YNNPACK by default in
recent jaxlibs, Eigen, XNNPACK, oneDNN) and has scheduler and vector-width switches; which
one is fastest depends on the host's vector extensions. This starts one
`benchmarks.throughput_jaxmoe` worker per option set (XLA_FLAGS must be set before JAX opens
its backend, so each set needs its own process), runs them in turns in short blocks, and
reports each set's median step time and its speed against the default set as the median
over blocks, with the spread. A set whose flags this jaxlib does not know fails at start-up
and is reported as failed, not dropped silently. The final loss of each set is reported too:
a code path that changes the numbers by more than rounding would show there.

    python -m benchmarks xla_cpu_options                         # top2, every option set
    python -m benchmarks xla_cpu_options --variants top2 dense --options default onednn_dot
    python -m benchmarks xla_cpu_options --json                  # + docs/results/DATE-NAME.json
"""

import argparse
import os
import statistics
import sys

from benchmarks.peer_harness import NOT_QUIET, is_quiet, load_average, start_worker, timed_blocks
from benchmarks.results import add_json_flag, markdown_table, publish

# name -> XLA_FLAGS added to the environment's own. Names say what changes against the
# default (jaxlib 0.10: YNNPACK fusions for dots, elementwise ops and reductions).
OPTIONS = {
    "default": "",
    "eigen_dots": "--xla_cpu_experimental_ynn_fusion_type=",
    "onednn_dot": "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot",
    "onednn_custom_call": "--xla_cpu_experimental_onednn_custom_call=true",
    "xnn_dot": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_experimental_xnn_fusion_type=dot",
    "concurrency_scheduler": "--xla_cpu_enable_concurrency_optimized_scheduler=true",
}
VARIANTS = ("top2", "top1", "adaptive", "dense", "fine_grained")


def option_env(flags: str) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(part for part in (env.get("XLA_FLAGS", ""), flags) if part)
    return env


def start_option_workers(variant: str, options: list[str], batches: int):
    """One worker per option set; a set that cannot start is recorded with its error."""
    workers, failed = {}, {}
    for name in options:
        try:
            workers[name] = start_worker(
                "throughput_jaxmoe",
                ["--variant", variant, f"--batches={batches}"],
                env=option_env(OPTIONS[name]),
            )
        except RuntimeError as error:
            failed[name] = str(error)
            print(f"xla_cpu_options: {variant} {name}: {error}", file=sys.stderr)
    return workers, failed


def measure_variant(variant: str, args, loads: list[float]) -> dict:
    workers, failed = start_option_workers(variant, args.options, args.warmup + args.steps)
    if "default" not in workers:
        raise RuntimeError(f"{variant}: the default option set did not start: {failed}")
    for name, worker in list(workers.items()):
        try:  # the first step compiles: a code path can crash there (SIGILL: exit -4)
            worker.steps(args.warmup)
        except RuntimeError as error:
            failed[name] = f"died compiling or running its first steps: {error}"
            print(f"xla_cpu_options: {variant} {name}: {failed[name]}", file=sys.stderr)
            del workers[name]
    if "default" not in workers:
        raise RuntimeError(f"{variant}: the default option set failed: {failed['default']}")
    measured = timed_blocks(workers, args.steps, args.blocks, loads)
    times, medians = measured["times"], measured["block_medians"]
    finals = {name: worker.stop() for name, worker in workers.items()}
    rows = []
    for name in workers:
        speedups = [d / o for d, o in zip(medians["default"], medians[name], strict=True)]
        rows.append(
            {
                "variant": variant,
                "option": name,
                "xla_flags": OPTIONS[name],
                "step_time_s": statistics.median(times[name]),
                "speed_vs_default": statistics.median(speedups),
                "min": min(speedups),
                "max": max(speedups),
                "final_loss": finals[name].get("loss"),
                "compiles": finals[name]["compiles"],
            }
        )
    for name, error in failed.items():
        rows.append(
            {"variant": variant, "option": name, "xla_flags": OPTIONS[name], "failed": error}
        )
    return rows


def run(args) -> dict:
    loads = [load_average()]
    rows = []
    for variant in args.variants:
        rows += measure_variant(variant, args, loads)
    loads.append(load_average())
    cores = os.cpu_count() or 1
    return {
        "rows": rows,
        "load_average_1min": {"before": loads[0], "during": loads[1:-1], "after": loads[-1]},
        # One worker runs at a time and XLA's pool takes every core.
        "quiet": is_quiet(loads, own_threads=cores),
        "cores": cores,
        "steps": args.steps,
        "blocks": args.blocks,
    }


def table(result: dict) -> str:
    rows = []
    for r in result["rows"]:
        if "failed" in r:
            rows.append([r["variant"], r["option"], None, None, None, f"failed: {r['failed']}"])
            continue
        rows.append(
            [
                r["variant"],
                r["option"],
                f"{r['step_time_s'] * 1e3:.1f}",
                f"{r['speed_vs_default']:.2f}x ({r['min']:.2f}-{r['max']:.2f})",
                r["final_loss"],
                r["xla_flags"] or "(none)",
            ]
        )
    header = [
        "variant",
        "option",
        "ms/step",
        "speed vs default (blocks)",
        "final loss",
        "XLA_FLAGS",
    ]
    load = result["load_average_1min"]
    lines = [
        markdown_table(header, rows),
        "",
        f"load average (1 min): before {load['before']:.1f}, during "
        f"{min(load['during'], default=0):.1f}-{max(load['during'], default=0):.1f}, "
        f"after {load['after']:.1f} on {result['cores']} cores",
    ]
    if not result["quiet"]:
        lines.append(NOT_QUIET)
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["top2"], choices=VARIANTS)
    parser.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    parser.add_argument("--steps", type=int, default=24, help="timed steps per option set")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compile + warm)")
    parser.add_argument("--blocks", type=int, default=6, help="turns of the option sets")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if "default" not in args.options:
        args.options = ["default", *args.options]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    publish("xla_cpu_options", result, table(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
