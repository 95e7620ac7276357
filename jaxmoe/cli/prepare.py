"""`jaxmoe prepare --config C`: tokenize and cache a config's data once, before training."""

import time


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "prepare", help="tokenize and cache the data of a config (what train opens), once"
    )
    parser.add_argument(
        "--config", default="configs/default.py", help="config file, optionally with :variant"
    )
    parser.set_defaults(run=run)


def run(args) -> int:
    from jaxmoe.checkpoints.manager import inherit_tokenizer
    from jaxmoe.checkpoints.staging import check_writable
    from jaxmoe.config.loading import load_config
    from jaxmoe.data.mixture import source_configs
    from jaxmoe.data.multihost import prepare
    from jaxmoe.data.sources import cache_dir

    config = load_config(args.config, args.overrides)
    inherit_tokenizer(config)  # what train will use: a train.init_from checkpoint's own
    check_writable(cache_dir(config))  # before any work: tokenizing ends in writes
    start = time.monotonic()
    tokenizer = prepare(config)
    print(
        f"prepared {len(source_configs(config))} source(s) with {tokenizer!r} under "
        f"{cache_dir(config)} in {time.monotonic() - start:.1f} s"
    )
    return 0
