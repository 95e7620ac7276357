"""Flags shared by several commands, and the checks of their values at parse time: a
nonsense number or an unwritable destination is refused before any work starts."""

import argparse
import math
import os
import sys

from jaxmoe.storage.paths import absolute_path, is_remote


class CommandParser(argparse.ArgumentParser):
    """A command's parser: a bad flag is one line naming it, not the whole usage above it."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        print(f"(see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):  # float() takes "nan" and "inf"; no count or rate is either
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _bounded(parse, ok, expected: str, doc: str):
    """An argparse `type=`: `parse(text)` (one line naming the text if it is not a number),
    then `ok(value)` or one line saying what was `expected`."""

    def check(text: str):
        value = parse(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    check.__doc__ = f"An argparse `type=`: {doc}."
    return check


positive_int = _bounded(_integer, lambda v: v >= 1, "a positive integer", "an integer >= 1")
non_negative_int = _bounded(_integer, lambda v: v >= 0, "an integer >= 0", "an integer >= 0")
non_negative_float = _bounded(_number, lambda v: v >= 0, "a number >= 0", "a finite number >= 0")
positive_float = _bounded(_number, lambda v: v > 0, "a number > 0", "a finite number > 0")
probability = _bounded(_number, lambda v: 0 < v <= 1, "a number in (0, 1]", "top-p: 1 = off")


def _writable_ancestor(path: str, wanted: str) -> None:
    """The deepest existing directory above `path` must be a writable directory."""
    parent = os.path.dirname(path)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(
            f"cannot write {wanted} {path}: {parent} is a file, not a directory"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {wanted} {path}: {parent} is read-only")


def writable_file(text: str) -> str:
    """An argparse `type=`: an absolute path a file can be written to (remote: unchecked)."""
    path = absolute_path(text)
    if is_remote(path):
        return path
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"cannot write file {path}: it is a directory")
    if os.path.lexists(path):
        if not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"cannot write file {path}: it is read-only")
        return path
    _writable_ancestor(path, "file")
    if not os.path.isdir(os.path.dirname(path)):
        raise argparse.ArgumentTypeError(
            f"cannot write file {path}: its directory {os.path.dirname(path)} does not exist"
        )
    return path


def writable_dir(text: str) -> str:
    """An argparse `type=`: an absolute path of a directory that exists or can be made, and
    written into (remote: unchecked)."""
    path = absolute_path(text)
    if is_remote(path):
        return path
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise argparse.ArgumentTypeError(f"cannot write into directory {path}: it is a file")
        if not os.access(path, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"cannot write into directory {path}: it is read-only")
        return path
    _writable_ancestor(path, "directory")
    return path


def add_override_flag(parser: argparse.ArgumentParser) -> None:
    """`--config.KEY=VALUE` in the usage and help. The CLI takes overrides out of the
    command line before parsing (cli/__init__.py), so this flag itself never matches."""
    parser.add_argument(
        "--config.KEY=VALUE",
        action="store_true",
        dest="_override_help",
        default=argparse.SUPPRESS,
        help="set any config key, repeatable (e.g. --config.train.steps=100 "
        "--config.model.dtype=bfloat16); `jaxmoe config [SECTION]` lists every key with "
        "its type, default and one-line doc",
    )


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    """Multi-process start-up flags (automatic on TPU pods and SLURM when left out)."""
    parser.add_argument(
        "--coordinator_address", default=None, help="host:port of process 0 (multi-process runs)"
    )
    parser.add_argument("--num_processes", type=positive_int, default=None)
    parser.add_argument("--process_id", type=non_negative_int, default=None)
    parser.add_argument(
        "--init_timeout",
        type=positive_int,
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
    from jaxmoe.storage.paths import absolute_data_spec

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
    parser.add_argument(
        "--base",
        type=absolute_path,
        default=None,
        help="a LoRA checkpoint's base checkpoint (same as --config.train.init_from=CKPT)",
    )
    add_override_flag(parser)


def checkpoint_config_override(args):
    """The config given with `--config` plus overrides, or None: the checkpoint's own.
    `--base CKPT` joins the overrides as train.init_from (a LoRA checkpoint's base)."""
    from jaxmoe.config.loading import load_config

    if getattr(args, "base", None):
        args.overrides.append(f"--config.train.init_from={args.base}")
    return load_config(args.config, args.overrides) if args.config else None


def module_docstring(name: str) -> str:
    """A module's docstring read from its source, without importing it (and what it imports):
    a command's help may quote the library module that does the work."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(name)
    with open(spec.origin, encoding="utf-8") as source:
        return ast.get_docstring(ast.parse(source.read())) or ""


def add_sampling_flags(parser) -> None:
    """The sampling flags of `jaxmoe decode` and `jaxmoe eval --task generate` (a parser or
    an argument group): temperature, top-k, top-p and the sampling seed."""
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        default=None,
        help="0 = greedy; default: 1 when --top_k or --top_p is given, else 0",
    )
    parser.add_argument("--top_k", type=non_negative_int, default=0, help="0 = off")
    parser.add_argument("--top_p", type=probability, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=non_negative_int, default=0)
