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


def run(args) -> int:
    import jax

    from jaxmoe.training.init_from import run_config
    from jaxmoe.training.loop import train

    config = run_config(args.config, args.overrides)
    initialize_from_flags(args)
    summary = train(config, args.workdir, progress=not args.no_progress)
    if jax.process_index() == 0:
        ev = summary["eval"] or {}
        if summary["stopped"] == "preempted":
            print(f"preempted at step {summary['step']}: checkpoint saved; rerun to resume")
        print(
            f"done: step {summary['step']}, eval loss {ev.get('loss', float('nan')):.4f} "
            f"(perplexity {ev.get('perplexity', float('nan')):.2f}, "
            f"accuracy {ev.get('accuracy', float('nan')):.3f})\n"
            f"checkpoints: {summary['checkpoints']}\n"
            f"tensorboard: tensorboard --logdir {summary['tensorboard']}\n"
            f"metrics:     {summary['metrics']}"
        )
        print(json.dumps({"step": summary["step"], **{f"eval_{k}": v for k, v in ev.items()}}))
    return 0
