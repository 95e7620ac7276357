"""`jaxmoe <command>`: parses flags and calls the library. Nothing else lives here."""

import argparse
import json
import logging
import os
import sys

from jaxmoe.disk_full import no_space_left, quiet_disk_full
from jaxmoe.parallel.sharding import ConfigError
from jaxmoe.paths import absolute_data_spec, absolute_path
from jaxmoe.platforms import skip_absent_tpu


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate `--config.a.b=v` overrides from ordinary flags."""
    overrides = [a for a in argv if a.startswith("--config.")]
    rest = [a for a in argv if not a.startswith("--config.")]
    return rest, overrides


def _add_distributed_flags(parser: argparse.ArgumentParser) -> None:
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


def _cmd_train(args, overrides) -> int:
    from jaxmoe.config import load_config
    from jaxmoe.distributed import initialize
    from jaxmoe.train import train

    config = load_config(args.config, overrides)
    initialize(args.coordinator_address, args.num_processes, args.process_id, args.init_timeout)
    summary = train(config, args.workdir, progress=not args.no_progress)
    import jax

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


def _cmd_prepare(args, overrides) -> int:
    import time

    from jaxmoe.config import load_config
    from jaxmoe.data.mixture import source_configs
    from jaxmoe.data.multihost import prepare
    from jaxmoe.data.sources import cache_dir

    config = load_config(args.config, overrides)
    start = time.monotonic()
    tokenizer = prepare(config)
    print(
        f"prepared {len(source_configs(config))} source(s) with {tokenizer!r} under "
        f"{cache_dir(config)} in {time.monotonic() - start:.1f} s"
    )
    return 0


def _cmd_eval(args, overrides) -> int:
    from jaxmoe.config import load_config
    from jaxmoe.distributed import initialize
    from jaxmoe.evaluate import evaluate

    initialize(args.coordinator_address, args.num_processes, args.process_id, args.init_timeout)
    config = load_config(args.config, overrides) if args.config else None
    if args.task == "generate":
        from jaxmoe.generate_eval import run_generate_eval

        result = run_generate_eval(args, config, overrides)
    else:
        result = evaluate(
            args.checkpoint,
            args.data,
            config=config,
            per_example=args.per_example,
            overrides=overrides,
        )
    print(json.dumps(result))
    return 0


def _cmd_lm_eval(args, overrides) -> int:
    try:
        from jaxmoe.lm_eval_backend import run_lm_eval
    except ImportError as error:
        raise RuntimeError(f"{error}; install the eval extra: pip install 'jaxmoe[eval]'") from None
    return run_lm_eval(args.lm_eval_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train or resume a model")
    train.add_argument(
        "--config", default="configs/default.py", help="config file, optionally with :variant"
    )
    train.add_argument(
        "--workdir",
        required=True,
        type=absolute_path,
        help="checkpoints, metrics, TensorBoard (local or gs://)",
    )
    train.add_argument("--no_progress", action="store_true", help="no progress bar")
    _add_distributed_flags(train)
    train.set_defaults(run=_cmd_train)

    prep = sub.add_parser(
        "prepare", help="tokenize and cache the data of a config (what train opens), once"
    )
    prep.add_argument(
        "--config", default="configs/default.py", help="config file, optionally with :variant"
    )
    prep.set_defaults(run=_cmd_prepare)

    ev = sub.add_parser("eval", help="score data with a checkpoint, sharded on the mesh")
    ev.add_argument(
        "--checkpoint",
        required=True,
        type=absolute_path,
        help="checkpoint dir (a step or a workdir)",
    )
    ev.add_argument(
        "--data",
        required=True,
        type=absolute_data_spec,
        help="jsonl:FILE, NAME/SPLIT (a prepared TFDS dataset) or embedded",
    )
    ev.add_argument(
        "--config", default=None, help="config file (default: the one stored with the checkpoint)"
    )
    ev.add_argument("--per_example", action="store_true", help="add per-example losses")
    ev.add_argument(
        "--task",
        choices=["score", "generate"],
        default="score",
        help="score: loss/perplexity/accuracy; generate: ROUGE/BLEU/EM/F1 of generations",
    )
    from jaxmoe.generate_eval import add_generate_flags

    add_generate_flags(ev)
    _add_distributed_flags(ev)
    ev.set_defaults(run=_cmd_eval)

    from jaxmoe.checkpoints import hf, hf_export, t5x_convert

    convert = sub.add_parser("convert", help="convert checkpoints into jaxmoe (t5x, hf, ...)")
    convert_sub = convert.add_subparsers(dest="format", required=True)
    t5x_convert.add_parser(convert_sub)
    hf.add_parser(convert_sub)
    from jaxmoe.checkpoints import convert as gqa_upcycle

    gqa_upcycle.add_parsers(convert_sub)
    export = sub.add_parser("export", help="export a jaxmoe checkpoint (hf, t5x)")
    export_sub = export.add_subparsers(dest="target", required=True)
    hf_export.add_parser(export_sub)
    from jaxmoe.checkpoints import t5x_export

    t5x_export.add_parser(export_sub)

    lm_eval = sub.add_parser(
        "lm-eval",
        add_help=False,
        help="lm-evaluation-harness tasks on a checkpoint: lm-eval's flags, --model jaxmoe implied",
    )
    lm_eval.set_defaults(run=_cmd_lm_eval, lm_eval_args=[])

    from jaxmoe.decode import add_decode_parser

    add_decode_parser(sub)

    from jaxmoe.compile import add_compile_parser

    add_compile_parser(sub)

    from jaxmoe import analysis

    _add_distributed_flags(analysis.add_parser(sub))
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
    skip_absent_tpu()  # before any backend starts: libtpu's probe would print to stderr
    try:
        with quiet_disk_full():
            return args.run(args, overrides)
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
        print(f"jaxmoe {args.command}: error: {error}", file=sys.stderr)
        _silence_abandoned_reads()
        return 2


def _silence_abandoned_reads() -> None:
    """After a failed checkpoint read, TensorStore still completes the reads Orbax had
    started, on its own threads, into an asyncio loop that is already closed; each prints a
    traceback at exit that would bury the one error line above; asyncio logs the futures
    nobody awaits any more, and the garbage collector reports their coroutines."""
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    sys.unraisablehook = lambda unraisable: None
    previous = sys.excepthook

    def hook(kind, value, traceback):
        if kind is RuntimeError and "Event loop is closed" in str(value):
            return
        previous(kind, value, traceback)

    sys.excepthook = hook


if __name__ == "__main__":
    sys.exit(main())
