"""`jaxmoe train --config C --workdir W`: train, or resume from W's latest checkpoint.

Fine-tuning: `--config.train.init_from=CKPT` without --config takes the model, tokenizer
and data format from CKPT (training/init_from.py); with --config the file's model keys must
agree with CKPT's."""

import json

from jaxmoe.cli.flags import add_distributed_flags, add_override_flag, initialize_from_flags


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train or resume a model")
    parser.add_argument(
        "--config",
        default=None,
        help="config file, optionally with :variant (default: configs/default.py, or with "
        "--config.train.init_from=CKPT and no --config, CKPT's own config)",
    )
    add_override_flag(parser)
    parser.add_argument(
        "--workdir",
        required=True,
        help="checkpoints, metrics, TensorBoard (local or gs://)",
    )
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    add_distributed_flags(parser)
    parser.set_defaults(run=run)


# A test hook, never a user setting (the README does not show it): tests/test_readme.py runs
# the README's commands exactly as typed and caps every training at this many steps, so the
# walkthrough fits in CI's time.
TEST_MAX_STEPS_ENV = "JAXMOE_TEST_MAX_STEPS"


def run(args) -> int:
    import os

    import jax

    from jaxmoe.storage.paths import absolute_path
    from jaxmoe.training.init_from import run_config
    from jaxmoe.training.loop import train
    from jaxmoe.training.run_report import report

    config = run_config(args.config, args.overrides)
    if os.environ.get(TEST_MAX_STEPS_ENV):
        steps = min(config.train.steps, int(os.environ[TEST_MAX_STEPS_ENV]))
        config = config.replace(train=config.train.replace(steps=steps))
    initialize_from_flags(args)
    summary = train(config, args.workdir, progress=not args.no_progress)
    if jax.process_index() == 0:
        print("\n".join(report(summary, absolute_path(args.workdir), config)))
        ev = summary["eval"] or {}
        print(json.dumps({"step": summary["step"], **{f"eval_{k}": v for k, v in ev.items()}}))
    return 0
