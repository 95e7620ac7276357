"""`jaxmoe analyze-routing --checkpoint C --data D --out DIR`: which tokens each MoE layer
sends to two experts; writes routing.json, plots and a summary, prints one JSON line."""

import argparse
import json

from jaxmoe.cli.flags import (
    add_checkpoint_flags,
    add_distributed_flags,
    checkpoint_config_override,
    initialize_from_flags,
    non_negative_int,
    positive_int,
    writable_dir,
)
from jaxmoe.inference.choices import GATE_CHOICES


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `analyze-routing` on the CLI's subparsers; returns the new parser."""
    parser = subparsers.add_parser(
        "analyze-routing", help="which tokens each MoE layer sends to two experts"
    )
    add_checkpoint_flags(parser)
    parser.add_argument(
        "--out",
        required=True,
        type=writable_dir,
        help="directory for routing.json, plots, summary",
    )
    parser.add_argument(
        "--gate",
        choices=GATE_CHOICES,
        default="train",
        help="whose decisions to count: the training gate (default) or the evaluation gate",
    )
    parser.add_argument(
        "--min_count",
        type=non_negative_int,
        default=20,
        help="pieces ranked only if seen this often",
    )
    parser.add_argument("--top", type=positive_int, default=15, help="pieces listed at each end")
    parser.add_argument(
        "--max_batches", type=non_negative_int, default=0, help="stop after N batches (0: all)"
    )
    add_distributed_flags(parser)
    parser.set_defaults(run=run)
    return parser


def run(args) -> int:
    """The command: analyse, write the files, print one JSON line with the main rates."""
    overrides = args.overrides
    import jax

    from jaxmoe.inference.routing_analysis import analyze_routing

    initialize_from_flags(args)
    config = checkpoint_config_override(args)
    result = analyze_routing(
        args.checkpoint,
        args.data,
        args.out,
        config=config,
        overrides=overrides,
        gate=args.gate,
        min_count=args.min_count,
        top_n=args.top,
        max_batches=args.max_batches,
    )
    if jax.process_index() == 0:
        line = {
            "top2_rate": {s: v["top2_rate"] for s, v in result["stacks"].items()},
            "top2_rate_per_layer": {r["layer"]: r["top2_rate"] for r in result["layers"]},
            "tokens": {s: v["tokens"] for s, v in result["stacks"].items()},
            "files": result["files"],
        }
        print(json.dumps(line))
    return 0
