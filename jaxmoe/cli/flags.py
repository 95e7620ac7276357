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


def add_checkpoint_flags(parser: argparse.ArgumentParser, data: bool = True) -> None:
    """`--checkpoint`, `--config` (default: the checkpoint's own) and, with `data`, `--data`:
    the flags of every command that reads a trained checkpoint."""
    from jaxmoe.storage.paths import absolute_data_spec, absolute_path

    parser.add_argument(
        "--checkpoint",
        required=True,
        type=absolute_path,
        help="checkpoint dir (a step or a workdir)",
    )
    if data:
        parser.add_argument(
            "--data",
            required=True,
            type=absolute_data_spec,
            help="jsonl:FILE, NAME/SPLIT (a prepared TFDS dataset) or embedded",
        )
    parser.add_argument(
        "--config", default=None, help="config file (default: the one stored with the checkpoint)"
    )


def checkpoint_config_override(args):
    """The config given with `--config` plus overrides, or None: the checkpoint's own."""
    from jaxmoe.config.loading import load_config

    return load_config(args.config, args.overrides) if args.config else None
