"""`jaxmoe export hf|t5x CKPT DST`: a jaxmoe checkpoint in another framework's format."""

import argparse
import json
import sys
import time
from pathlib import Path

from jaxmoe.checkpoints.dtypes import OUTPUT_DTYPES
from jaxmoe.cli.flags import non_negative_int
from jaxmoe.conversions.choices import DEFAULT_MAX_SHARD_SIZE
from jaxmoe.errors import CheckpointError
from jaxmoe.storage.paths import absolute_path


def add_parser(subparsers) -> None:
    """Registers `jaxmoe export` and its targets."""
    export = subparsers.add_parser("export", help="export a jaxmoe checkpoint (hf, t5x)")
    targets = export.add_subparsers(dest="target", required=True)
    _add_hf(targets)
    _add_t5x(targets)


def export_hf_summary(
    ckpt: str,
    dst: str,
    dtype: str = "float32",
    tokenizer: str | None = None,
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
    base: str | None = None,
    peft: bool = False,
) -> int:
    """`jaxmoe export hf CKPT DST [--dtype] [--tokenizer] [--max_shard_size] [--base B |
    --peft]`: prints one JSON line."""
    from jaxmoe.checkpoints.staging import check_new_directory, interrupts_in_one_line
    from jaxmoe.conversions.hf.exporter import export_hf
    from jaxmoe.conversions.hf.tokenizer_files import TOKENIZER_FILES

    check_new_directory(dst)  # before any work: the write comes last
    if Path(dst).is_file():
        raise CheckpointError(
            f"{Path(dst).absolute()}: already exists; exporting writes a new directory"
        )
    start = time.perf_counter()
    if peft:
        from jaxmoe.conversions.hf.export_peft import export_peft

        with interrupts_in_one_line(dst):
            adapter = export_peft(ckpt, dst, dtype)
        summary = {
            "exported": str(Path(dst).absolute()),
            "peft": {k: adapter[k] for k in ("r", "lora_alpha")},
            "dtype": dtype,
            "seconds": round(time.perf_counter() - start, 2),
        }
        print(json.dumps(summary))
        return 0
    _refuse_bare_adapters(ckpt, base)
    with interrupts_in_one_line(dst), _merged(ckpt, base, dst) as source:
        hf_config = export_hf(source, dst, dtype, tokenizer, max_shard_size)
    summary = {
        "exported": str(Path(dst).absolute()),
        "architecture": hf_config["architectures"][0],
        "dtype": dtype,
        "tokenizer": any((Path(dst) / name).exists() for name in TOKENIZER_FILES),
        # transformers runs the model's own code (a gate Mixtral's has not) only when asked.
        "trust_remote_code": "auto_map" in hf_config,
        "seconds": round(time.perf_counter() - start, 2),
    }
    print(json.dumps(summary))
    if summary["trust_remote_code"]:
        modules = sorted({name.split(".")[0] + ".py" for name in hf_config["auto_map"].values()})
        print(
            f"note: {dst} holds {summary['architecture']}, whose gate is Python code it "
            f"carries ({', '.join(modules)}): transformers loads it, and its tokenizer, with "
            f"trust_remote_code=True",
            file=sys.stderr,
        )
    return 0


def _refuse_bare_adapters(ckpt: str, base: str | None) -> None:
    """A LoRA checkpoint (adapters only) exports with --peft, or merged with --base."""
    from jaxmoe.config.stored import read_config

    rank = read_config(ckpt, tokenizer=False).train.lora.rank
    if rank and not base:
        raise CheckpointError(
            f"checkpoint {ckpt!r} holds LoRA adapters only (train.lora.rank={rank}): --peft "
            "writes them as a PEFT adapter folder, --base CKPT writes the merged model"
        )
    if base and not rank:
        raise CheckpointError(f"--base {base}: checkpoint {ckpt!r} is a whole model already")


def _merged(ckpt: str, base: str | None, dst: str):
    """A context giving the checkpoint to export: `ckpt`, or its merge onto `base`."""
    import contextlib

    if not base:
        return contextlib.nullcontext(ckpt)
    from jaxmoe.conversions.lora_merge import merged_copy

    return merged_copy(ckpt, base, dst)


def _add_hf(subparsers) -> argparse.ArgumentParser:
    """Registers `hf` under the `jaxmoe export` subcommands (runs `run_hf(args)`)."""
    parser = subparsers.add_parser(
        "hf",
        help="jaxmoe checkpoint -> Hugging Face config.json + model.safetensors",
        description=(
            "Write a jaxmoe checkpoint as a Hugging Face model directory that transformers "
            "loads: dense decoders as Llama (with q/k/v biases: Qwen2), top-k MoE decoders "
            "as Mixtral (with q/k norms or a shared expert: Qwen3-MoE, OLMoE, Qwen2-MoE; with "
            "attention sinks: GPT-OSS), "
            "other MoE gates (adaptive, top-p) as Mixtral with jaxmoe's router "
            "(trust_remote_code), T5 v1.1 as T5, each with its tokenizer. Models HF cannot "
            "express (dense layers in a Mixtral, capacity_factor > 0, GQA T5) are refused."
        ),
    )
    parser.add_argument(
        "ckpt", type=absolute_path, help="jaxmoe checkpoint (a step directory or a workdir)"
    )
    parser.add_argument("dst", type=absolute_path, help="new Hugging Face model directory")
    parser.add_argument("--dtype", default="float32", choices=sorted(OUTPUT_DTYPES))
    parser.add_argument(
        "--tokenizer",
        type=absolute_path,
        default=None,
        help="tokenizer to export: a SentencePiece .model (written as tokenizer.json) or a "
        "Hugging Face tokenizer.json / folder (copied); default: data.tokenizer",
    )
    parser.add_argument(
        "--max_shard_size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="largest safetensors file (e.g. 5GB, 500MB, 2GiB); more tensors: shards + index",
    )
    lora = parser.add_mutually_exclusive_group()
    lora.add_argument(
        "--base",
        type=absolute_path,
        default=None,
        help="a LoRA checkpoint: its base checkpoint; the merged model is written",
    )
    lora.add_argument(
        "--peft",
        action="store_true",
        help="a LoRA checkpoint: write its adapters as a PEFT adapter folder "
        "(adapter_config.json + adapter_model.safetensors) for peft.PeftModel.from_pretrained",
    )
    parser.set_defaults(run=run_hf)
    return parser


def run_hf(args) -> int:
    overrides = args.overrides
    if overrides:
        raise CheckpointError(f"export hf takes no --config overrides (got {overrides[0]!r})")
    return export_hf_summary(
        args.ckpt, args.dst, args.dtype, args.tokenizer, args.max_shard_size, args.base, args.peft
    )


def _add_t5x(subparsers) -> argparse.ArgumentParser:
    """Registers `t5x` under the `jaxmoe export` subcommands (runs `run_t5x(args)`)."""
    parser = subparsers.add_parser(
        "t5x",
        help="jaxmoe T5.1.1 checkpoint -> T5X checkpoint (msgpack + TensorStore)",
        description=(
            "Write a jaxmoe T5.1.1 encoder-decoder as a T5X checkpoint OUT/checkpoint_<step>/ "
            "(T5X's names and 2-D kernels; Adafactor state: the checkpoint's own "
            "t5x_adafactor state if it has one, else T5X's initial state)."
        ),
    )
    parser.add_argument("ckpt", type=absolute_path, help="jaxmoe checkpoint (step dir or workdir)")
    parser.add_argument("out", type=absolute_path, help="T5X model directory to write into")
    parser.add_argument("--dtype", default="float32", choices=sorted(OUTPUT_DTYPES))
    parser.add_argument(
        "--step", type=non_negative_int, default=None, help="T5X step (default: the source's, or 0)"
    )
    parser.set_defaults(run=run_t5x)
    return parser


def run_t5x(args) -> int:
    """`jaxmoe export t5x CKPT OUT [--dtype] [--step]`: prints one JSON line."""
    from jaxmoe.checkpoints.staging import check_writable, interrupts_in_one_line
    from jaxmoe.conversions.t5x.exporter import export_t5x

    if args.overrides:
        raise CheckpointError(f"export t5x takes no --config overrides (got {args.overrides[0]!r})")
    check_writable(args.out)  # before any work: the write comes last
    start = time.perf_counter()
    with interrupts_in_one_line(args.out):
        written = export_t5x(args.ckpt, args.out, dtype=args.dtype, step=args.step)
    summary = {
        "checkpoint": str(written),
        "dtype": args.dtype,
        "seconds": round(time.perf_counter() - start, 2),
    }
    print(json.dumps(summary))
    return 0
