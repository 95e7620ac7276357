"""Flags shared by several commands."""

import argparse


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    """Multi-process start-up flags (automatic on TPU pods and SLURM when left out)."""
    parser.add_argument(
        "--coordinator_address", default=None, help="host:port of process 0 (multi-process runs)"
    )
    parser.add_argument("--num_processes", type=int, default=None)
    parser.add_argument("--process_id", type=int, default=None)
    parser.add_argument(
        "--init_timeout",
        type=int,
        default=None,
        help="seconds to wait for all processes to join (default 300)",
    )


def initialize_from_flags(args) -> None:
    """`jax.distributed.initialize` from the flags above (before any device is used)."""
    from jaxmoe.parallel.distributed import initialize

    initialize(args.coordinator_address, args.num_processes, args.process_id, args.init_timeout)
