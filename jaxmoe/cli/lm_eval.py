"""`jaxmoe lm-eval --tasks T --model_args checkpoint=C ...`: lm-evaluation-harness tasks on a
checkpoint. Every flag after `lm-eval` is lm-eval's own (`--model jaxmoe` is implied)."""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "lm-eval",
        add_help=False,
        help="lm-evaluation-harness tasks on a checkpoint: lm-eval's flags, --model jaxmoe implied",
    )
    parser.set_defaults(run=run, lm_eval_args=[])


def run(args) -> int:
    try:
        from jaxmoe.inference.lm_eval_backend import run_lm_eval
    except ImportError as error:
        raise RuntimeError(f"{error}; install the eval extra: pip install 'jaxmoe[eval]'") from None
    return run_lm_eval(args.lm_eval_args)
