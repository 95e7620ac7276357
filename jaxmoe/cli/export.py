"""`jaxmoe export hf CKPT DST`: a jaxmoe checkpoint in another framework's format."""

import argparse
import json
import time
from pathlib import Path

from jaxmoe.checkpoints.dtypes import OUTPUT_DTYPES
from jaxmoe.checkpoints.hf.exporter import DEFAULT_MAX_SHARD_SIZE, export_hf
from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.storage.paths import absolute_path


def add_parser(subparsers) -> None:
    """Registers `jaxmoe export` and its targets."""
    export = subparsers.add_parser("export", help="export a jaxmoe checkpoint (hf)")
    targets = export.add_subparsers(dest="target", required=True)
    _add_hf(targets)


def export_hf_summary(
    ckpt: str,
    dst: str,
    dtype: str = "float32",
    tokenizer: str | None = None,
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
) -> int:
    """`jaxmoe export hf CKPT DST [--dtype] [--tokenizer] [--max_shard_size]`: prints one
    JSON line."""
    start = time.perf_counter()
    hf_config = export_hf(ckpt, dst, dtype, tokenizer, max_shard_size)
    summary = {
        "exported": str(Path(dst).absolute()),
        "architecture": hf_config["architectures"][0],
        "dtype": dtype,
        "tokenizer": (Path(dst) / "tokenizer.json").exists(),
        "seconds": round(time.perf_counter() - start, 2),
    }
    print(json.dumps(summary))
    return 0


def _add_hf(subparsers) -> argparse.ArgumentParser:
    """Registers `hf` under the `jaxmoe export` subcommands (runs `run_hf(args)`)."""
    parser = subparsers.add_parser(
        "hf",
        help="jaxmoe checkpoint -> Hugging Face config.json + model.safetensors",
        description=(
            "Write a jaxmoe checkpoint as a Hugging Face model directory that transformers "
            "loads: dense decoders as Llama (with q/k/v biases: Qwen2), top-k MoE decoders "
            "as Mixtral, T5 v1.1 as T5. "
            "Models HF cannot express (adaptive gating, moe.every > 1, GQA T5) are refused."
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
        help="SentencePiece .model to write as tokenizer.json (default: data.tokenizer)",
    )
    parser.add_argument(
        "--max_shard_size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="largest safetensors file (e.g. 5GB, 500MB, 2GiB); more tensors: shards + index",
    )
    parser.set_defaults(run=run_hf)
    return parser


def run_hf(args) -> int:
    overrides = args.overrides
    if overrides:
        raise CheckpointError(f"export hf takes no --config overrides (got {overrides[0]!r})")
    return export_hf_summary(args.ckpt, args.dst, args.dtype, args.tokenizer, args.max_shard_size)
