"""`jaxmoe prepare --config C`: tokenize and cache a config's data once, before training;
with data.shards, `--process_id I --num_processes N` prepares what process I of N reads."""

import time

from jaxmoe.cli.flags import add_override_flag, non_negative_int, positive_int


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "prepare", help="tokenize and cache the data of a config (what train opens), once"
    )
    parser.add_argument(
        "--config",
        default=None,
        help="config file, optionally with :variant (default: as `jaxmoe train`: "
        "configs/default.py, or CKPT's own with --config.train.init_from=CKPT)",
    )
    add_override_flag(parser)
    shards = "with data.shards: prepare only the train shards that process of a run reads"
    parser.add_argument("--process_id", type=non_negative_int, default=0, help=shards)
    parser.add_argument(
        "--num_processes", type=positive_int, default=1, help="(default 1: every shard)"
    )
    parser.set_defaults(run=run)


def run(args) -> int:
    from jaxmoe.checkpoints.staging import check_writable
    from jaxmoe.config.stored import inherit_tokenizer
    from jaxmoe.data.mixture import source_sections
    from jaxmoe.data.multihost import prepare
    from jaxmoe.data.sources import cache_dir

    if args.process_id >= args.num_processes:
        raise ValueError(
            f"--process_id={args.process_id} is not below --num_processes={args.num_processes}"
        )
    from jaxmoe.training.init_from import run_config

    config = run_config(args.config, args.overrides)  # what train will run
    config = inherit_tokenizer(config)  # what train will use: a train.init_from checkpoint's
    data, batch_size = config.data, config.train.batch_size
    check_writable(cache_dir(data))  # before any work: tokenizing ends in writes
    if data.shards:
        from jaxmoe.data.shards import check_shards, prepare_shards

        check_shards(data, batch_size, args.num_processes)  # before any work too
    start = time.monotonic()
    tokenizer = prepare(data, config.train)
    if data.shards:
        prepare_shards(data, batch_size, tokenizer, args.process_id, args.num_processes)
    print(
        f"prepared {len(source_sections(data))} source(s) with {tokenizer!r} under "
        f"{cache_dir(data)} in {time.monotonic() - start:.1f} s"
    )
    return 0
