"""Training throughput of the tiny Mixtral (configs/tiny_mixtral.py), optionally against peers.

Each system runs in its own worker process (throughput_jaxmoe.py never imports torch,
throughput_hf.py never imports JAX), driven from here over stdin/stdout: after a warm-up,
the workers take turns running short blocks of steps, so a drifting load hits both alike
while neither shares an interpreter or a thread pool with the other. jaxmoe runs its real
train step (jaxmoe.training.steps.train_step, jitted with the state's shardings and donation as in
jaxmoe/training/trainer.py) on one device; the peer is Hugging Face transformers' MixtralForCausalLM
(LlamaForCausalLM for :dense) with torch AdamW, same sizes, batch and threads. The
:fine_grained variant (throughput_jaxmoe.FINE_GRAINED: 64 experts of FFN 128, top-8
renormalised, per-head QK-norm, on the tiny Mixtral's other sizes) runs against
transformers' Qwen3MoeForCausalLM (HF only). Steps are
timed one by one (a sync after each) on fresh random token batches made beforehand.
The MaxText peer (throughput_maxtext.py) runs MaxText's own Mixtral (Llama for :dense) and
train step under the interpreter of its own venv (--maxtext_venv, which has its own JAX), on
one CPU device; without that venv it is skipped with one line on stderr.

Reported: median step time, tokens/s, model FLOPs per token (jaxmoe/models/flops.py; adaptive at
its measured top-2 share), FLOP/s (MFU with --peak_flops), and per variant the ratio of
jaxmoe's tokens/s to the peer's as the median over blocks with its spread (min, max). The
1-minute load average is sampled before, after every block and after; a run with more than
half the cores of load from other processes (before it, or on top of its own busy threads
during it) is flagged `"quiet": false` with a warning: its ratios are not comparable
(PyTorch's OpenMP threads slow down far more under contention than XLA's).

    python -m benchmarks train_throughput                   # jaxmoe, all variants
    python -m benchmarks train_throughput --peer hf         # side by side, with ratios
    python -m benchmarks train_throughput --peer hf --json  # + docs/results/DATE-NAME.json
    python -m benchmarks train_throughput --peer maxtext    # or --peer hf,maxtext / all
    python -m benchmarks train_throughput --variants top2 --steps 5 --warmup 2 --blocks 1
    python -m benchmarks train_throughput --peer hf --variants fine_grained --json
    python -m benchmarks train_throughput --set model.dtype=bfloat16 --peak_flops 989e12
"""

import argparse
import json
import os
import statistics
import sys

from benchmarks.peer_harness import (
    DEFAULT_MAXTEXT_VENV,
    NOT_QUIET,
    is_quiet,
    load_average,
    maxtext_env,
    start_worker,
    timed_blocks,
    venv_python,
)
from benchmarks.results import add_json_flag, markdown_table, publish

VARIANTS = ("top2", "top1", "adaptive", "dense", "fine_grained")
PEER_OF = {v: v for v in VARIANTS} | {"adaptive": "top1"}
# Variants measured in one interleaved group: each group shares its peer run.
GROUPS = (("top2",), ("top1", "adaptive"), ("dense",), ("fine_grained",))
PEERS = ("hf", "maxtext")
NO_PEER = {("maxtext", "fine_grained")}  # throughput_maxtext.py builds Mixtral / Llama only
# What each worker may import (worker_protocol.serve reports it): never the other system.
IMPORTS = {"jaxmoe": ["jax", "jaxmoe"], "hf": ["torch"], "maxtext": ["jax"]}


def peer_list(text: str) -> list[str]:
    """`none`, `all`, or a comma-separated list of PEERS."""
    if text == "none":
        return []
    peers = list(PEERS) if text == "all" else text.split(",")
    for peer in peers:
        if peer not in PEERS:
            raise argparse.ArgumentTypeError(f"unknown peer {peer!r} ({', '.join(PEERS)})")
    return peers


def start_workers(variants, args, peers) -> dict:
    num_batches = args.warmup + args.steps
    overrides = [f"--set={item}" for item in args.set]
    workers = {}
    for variant in variants:
        workers[("jaxmoe", variant)] = start_worker(
            "throughput_jaxmoe", ["--variant", variant, f"--batches={num_batches}", *overrides]
        )
    peer = PEER_OF[variants[0]]
    spec = workers[("jaxmoe", variants[0])].ready["peer_spec"]
    if "hf" in peers:
        workers[("hf", peer)] = start_worker(
            "throughput_hf",
            [
                "--peer",
                peer,
                "--spec",
                json.dumps(spec),
                f"--threads={args.threads}",
                f"--batches={num_batches}",
            ],
        )
    if "maxtext" in peers:
        workers[("maxtext", peer)] = start_worker(
            "throughput_maxtext",
            [
                "--peer",
                peer,
                "--spec",
                json.dumps(spec),
                f"--batches={num_batches}",
                f"--moe={args.maxtext_moe}",
            ],
            env=maxtext_env(),
            python=str(venv_python(args.maxtext_venv)),
        )
    return workers


def measure(workers: dict, args, loads: list[float]) -> dict:
    """Per worker: its step times, and the median of each block."""
    for worker in workers.values():
        worker.steps(args.warmup)
    return timed_blocks(workers, args.steps, args.blocks, loads)


def row(variant, system, times, ready, final, peak_flops) -> dict:
    median = statistics.median(times)
    tokens = ready["tokens_per_step"] if system == "jaxmoe" else None
    out = {"variant": variant, "system": system, "step_time_s": median, "steps": len(times)}
    if system == "jaxmoe":
        share = final.get("top2_fraction")
        flops = ready["flops_top1"]
        if variant == "adaptive" and share is not None:
            flops += share * (ready["flops_top2"] - ready["flops_top1"])
        out |= {
            "tokens_per_s": tokens / median,
            "flops_per_token": flops / tokens,
            "flops_per_s": flops / median,
        }
        if share is not None:
            out["top2_fraction"] = share
        if peak_flops:
            out["mfu"] = flops / median / peak_flops
    return out


def run(args) -> dict:
    peers, skipped = list(args.peer), {}
    if "maxtext" in peers and venv_python(args.maxtext_venv) is None:
        skipped["maxtext"] = f"no MaxText venv at {args.maxtext_venv} (no bin/python)"
        print(f"train_throughput: skipping the MaxText peer: {skipped['maxtext']}", file=sys.stderr)
        peers.remove("maxtext")
    loads = [load_average()]
    rows, ratios, imported = [], {}, {}
    for group in GROUPS:
        variants = [v for v in group if v in args.variants]
        if not variants:
            continue
        group_peers = [p for p in peers if (p, PEER_OF[variants[0]]) not in NO_PEER]
        for p in sorted(set(peers) - set(group_peers)):
            skipped[f"{p}_{PEER_OF[variants[0]]}"] = "no such model in this peer"
        workers = start_workers(variants, args, group_peers)
        measured = measure(workers, args, loads)
        finals = {name: worker.stop() for name, worker in workers.items()}
        for (system, variant), final in finals.items():
            imported[f"{system}_{variant}"] = final["imported"]
            if final["imported"] != IMPORTS[system]:
                raise RuntimeError(f"{system} worker imported {final['imported']}")
        reference = workers[("jaxmoe", variants[0])].ready
        for (system, variant), times in measured["times"].items():
            ready = workers[(system, variant)].ready
            if system == "jaxmoe" and finals[(system, variant)]["compiles"] != 1:
                raise RuntimeError(f"{variant}: the train step compiled more than once")
            out = row(variant, system, times, ready, finals[(system, variant)], args.peak_flops)
            if system != "jaxmoe":  # same tokens per step as jaxmoe's
                if (
                    ready.get("tokens_per_step", reference["tokens_per_step"])
                    != (reference["tokens_per_step"])
                ):
                    raise RuntimeError(f"{system} trains {ready['tokens_per_step']} tokens/step")
                out["tokens_per_s"] = reference["tokens_per_step"] / out["step_time_s"]
                out["num_params"] = ready["num_params"]
                if "moe" in ready:
                    out["moe"] = ready["moe"]
            rows.append(out)
        for system in group_peers:
            peer = (system, PEER_OF[variants[0]])
            for variant in variants:
                # Same tokens per step: the speed ratio is the inverse ratio of step times.
                per_block = [
                    p / m
                    for m, p in zip(
                        measured["block_medians"][("jaxmoe", variant)],
                        measured["block_medians"][peer],
                        strict=True,
                    )
                ]
                ratios[f"jaxmoe_{variant}/{system}_{peer[1]}"] = {
                    "ratio": statistics.median(per_block),
                    "min": min(per_block),
                    "max": max(per_block),
                    "blocks": len(per_block),
                }
    loads.append(load_average())
    cores = os.cpu_count() or 1
    quiet = is_quiet(loads, own_threads=max(cores, args.threads))  # XLA's pool: every core
    return {
        "rows": rows,
        "ratios": ratios,
        "load_average_1min": {"before": loads[0], "during": loads[1:-1], "after": loads[-1]},
        "quiet": quiet,
        "cores": cores,
        "threads": args.threads,
        "imported": imported,
        "skipped": skipped,
    }


def table(result: dict) -> str:
    """The rows, the ratios and the load as Markdown."""
    rows = []
    for r in result["rows"]:
        notes = [f"top2_fraction {r['top2_fraction']:.2f}"] if "top2_fraction" in r else []
        notes += [f"MFU {r['mfu']:.1%}"] if "mfu" in r else []
        rows.append(
            [
                r["variant"],
                r["system"],
                f"{r['tokens_per_s']:.0f}",
                f"{r['step_time_s'] * 1e3:.1f}",
                f"{r['flops_per_token'] / 1e9:.3f}" if "flops_per_s" in r else None,
                f"{r['flops_per_s'] / 1e9:.1f}" if "flops_per_s" in r else None,
                ", ".join(notes),
            ]
        )
    header = ["variant", "system", "tok/s", "ms/step", "GFLOP/tok", "GFLOP/s", "notes"]
    lines = [markdown_table(header, rows), ""]
    for name, value in result["ratios"].items():
        lines.append(
            f"{name}: {value['ratio']:.2f}x (blocks: {value['min']:.2f}-{value['max']:.2f}, "
            f"{value['blocks']} blocks)  "
        )
    load = result["load_average_1min"]
    lines.append(
        f"load average (1 min): before {load['before']:.1f}, during "
        f"{min(load['during'], default=0):.1f}-{max(load['during'], default=0):.1f}, "
        f"after {load['after']:.1f} on {result['cores']} cores"
    )
    if not result["quiet"]:
        lines.append(NOT_QUIET)
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument(
        "--peer", type=peer_list, default="none", help="none, hf, maxtext, hf,maxtext or all"
    )
    parser.add_argument(
        "--maxtext_venv", default=DEFAULT_MAXTEXT_VENV, help="MaxText's venv (own JAX)"
    )
    parser.add_argument(
        "--maxtext_moe", choices=("ragged", "dense"), default="ragged", help="MaxText's MoE path"
    )
    parser.add_argument("--steps", type=int, default=40, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compile + warm)")
    parser.add_argument("--blocks", type=int, default=8, help="alternations of the systems")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--set", action="append", default=[], help="config override k=v")
    parser.add_argument("--peak_flops", type=float, default=0.0, help="chip peak, for MFU")
    add_json_flag(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    publish("train_throughput", result, table(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
