"""`jaxmoe <command>`: parses flags and calls the library. Nothing else lives here.

One module per command, each with `add_parser(subparsers)` (which sets `run`) and
`run(args) -> exit code`; `--config.KEY=VALUE` overrides arrive as `args.overrides`.
The command modules import only what their parsers need (argparse and light constant
modules); each `run` imports the library it calls, so `--help` never starts JAX.
"""

import argparse
import logging
import os
import signal
import sys
import warnings

from jaxmoe.cli import analyze_routing, convert, decode, export, lm_eval, merge, prepare, train
from jaxmoe.cli import compile as compile_command  # not the builtins
from jaxmoe.cli import config as config_command
from jaxmoe.cli import eval as eval_command
from jaxmoe.cli.flags import CommandParser
from jaxmoe.cli.progress import announced
from jaxmoe.errors import ConfigError
from jaxmoe.parallel.environment import check_environment
from jaxmoe.parallel.host_memory import retain_freed_host_memory
from jaxmoe.parallel.platforms import skip_absent_tpu
from jaxmoe.storage.background_errors import quiet_background_errors
from jaxmoe.storage.disk_full import no_space_left, quiet_disk_full
from jaxmoe.storage.interrupts import signal_name, terminate_as_interrupt


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate `--config.a.b=v` overrides from ordinary flags."""
    overrides = [a for a in argv if a.startswith("--config.")]
    rest = [a for a in argv if not a.startswith("--config.")]
    return rest, overrides


# Commands whose time goes into XLA computations: on the CPU they keep freed host memory
# (parallel/host_memory.py). Converters stream tensor by tensor and want it returned.
COMPUTING = {"train", "eval", "lm-eval", "decode", "analyze-routing"}

COMMANDS = (
    train,
    prepare,
    eval_command,
    lm_eval,
    convert,
    export,
    merge,
    decode,
    compile_command,
    analyze_routing,
    config_command,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxmoe", description="Train, convert, evaluate and decode MoE and GQA models."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lm-eval"]:  # every later flag is lm-eval's, parsed by lm-eval itself
        args = build_parser().parse_args(["lm-eval"])
        args.lm_eval_args, overrides = argv[1:], []
    else:
        rest, overrides = _split_overrides(argv)
        args = build_parser().parse_args(rest)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.command == "lm-eval" and lm_eval.wants_help(args):
        return lm_eval.print_help()  # lm-eval's own help: no backend, so no JAX
    try:  # compile builds TPU devices from a topology alone: no platform needed
        check_environment(platforms=args.command != "compile")
    except ConfigError as error:
        print(f"jaxmoe {args.command}: error: {error}", file=sys.stderr)
        return 2
    skip_absent_tpu()  # before any backend starts: libtpu's probe would print to stderr
    if args.command in COMPUTING:
        retain_freed_host_memory()  # before any backend starts its threads
    try:
        with (
            quiet_disk_full(),
            quiet_background_errors(),
            terminate_as_interrupt(),
            announced(args.command, _doing(args)),
        ):
            args.overrides = overrides
            return args.run(args)
    except KeyboardInterrupt as interrupt:  # Ctrl-C or SIGTERM: `finally` blocks cleaned up
        if os.environ.get("JAXMOE_TRACEBACK"):
            raise
        _silence_abandoned_reads()
        name = signal_name(interrupt)
        print(f"jaxmoe {args.command}: interrupted by {name}", file=sys.stderr)
        return 128 + getattr(signal, name)
    except Exception as error:
        # One line for the user; JAX internals are not their problem.
        if os.environ.get("JAXMOE_TRACEBACK"):
            raise
        if no_space_left(error):  # converters, export: `train` names its workdir itself
            where = next(
                (getattr(args, k) for k in ("dst", "out", "workdir") if getattr(args, k, None)),
                None,
            )
            error = f"no space left on {where or 'the device'}"
        elif not isinstance(error, ConfigError | ValueError | FileNotFoundError | RuntimeError):
            raise
        _silence_abandoned_reads()  # first: the collector may report them while printing
        print(f"jaxmoe {args.command}: error: {error}", file=sys.stderr)
        return 2


def _doing(args) -> str | None:
    """What a command that can work for minutes before printing anything is doing (the
    progress line at a terminal, cli/progress.py); None for the others."""
    if args.command == "compile":
        return (
            f"compiling the train step of {args.config} for {args.topology} (the TPU or "
            f"GPU compiler takes minutes for a large model)"
        )
    if args.command == "convert":
        return f"converting {args.src} into {args.dst}"
    if args.command == "export":
        return (
            f"exporting {args.ckpt} as {args.target} into {getattr(args, 'dst', None) or args.out}"
        )
    if args.command == "prepare":
        # No --config: the config `jaxmoe train` would run (prepare.py's default).
        config = args.config or "configs/default.py (or the init_from checkpoint's config)"
        return f"tokenizing and caching the data of {config}"
    return None


def _silence_abandoned_reads() -> None:
    """After a failed checkpoint read, TensorStore still completes the reads Orbax had
    started, on its own threads, into an asyncio loop that is already closed; each prints a
    traceback at exit that would bury the one error line above; asyncio logs the futures
    nobody awaits any more, and the garbage collector reports their coroutines (as
    RuntimeWarnings, when an interrupt stopped Orbax between creating and awaiting one)."""
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited")
    sys.unraisablehook = lambda unraisable: None
    previous = sys.excepthook

    def hook(kind, value, traceback):
        if kind is RuntimeError and "Event loop is closed" in str(value):
            return
        previous(kind, value, traceback)

    sys.excepthook = hook
