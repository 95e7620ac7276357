"""`jaxmoe lm-eval --tasks T --model_args checkpoint=C ...`: lm-evaluation-harness tasks on a
checkpoint. Every flag after `lm-eval` is lm-eval's own (`--model jaxmoe` is implied)."""

import sys

EXTRA_HINT = "install the eval extra: pip install 'jaxmoe[eval]'"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "lm-eval",
        add_help=False,
        help="lm-evaluation-harness tasks on a checkpoint: lm-eval's flags, --model jaxmoe implied",
    )
    parser.set_defaults(run=run, lm_eval_args=[])


def wants_help(args) -> bool:
    return bool({"-h", "--help"} & set(args.lm_eval_args))


def run(args) -> int:
    if wants_help(args):
        return print_help()
    try:
        from jaxmoe.inference.lm_eval_backend import run_lm_eval
    except ImportError as error:
        raise RuntimeError(f"{error}; {EXTRA_HINT}") from None
    return run_lm_eval(join_processes(args.lm_eval_args))


def join_processes(argv: list[str]) -> list[str]:
    """`argv` without jaxmoe's multi-process flags (launch/local.sh appends them), after
    joining the run they describe (or a detected pod / SLURM job): each process is then
    one of lm-eval's data-parallel ranks."""
    import argparse
    import time

    from jaxmoe.cli.flags import add_distributed_flags, initialize_from_flags
    from jaxmoe.inference import across_processes

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # lm-eval's flags
    add_distributed_flags(parser)
    flags, rest = parser.parse_known_args(argv)
    start, clock = time.time(), time.perf_counter()
    initialize_from_flags(flags)
    seconds = time.perf_counter() - clock
    # Start-up before this (imports) and the join itself, for benchmarks/lm_eval_processes.py.
    started = across_processes.process_started()
    across_processes.log_timing("join", start, seconds, process_started=started)
    return rest


def print_help() -> int:
    """lm-eval's own `run --help`, without jaxmoe's backend (which starts JAX)."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as error:
        raise RuntimeError(f"{error}; {EXTRA_HINT}") from None
    print("jaxmoe lm-eval: lm-eval's flags below; --model jaxmoe is implied\n")
    sys.argv = ["jaxmoe lm-eval", "run", "--help"]
    try:
        cli_evaluate()
    except SystemExit as done:  # argparse leaves after printing the help
        return done.code or 0
    return 0
