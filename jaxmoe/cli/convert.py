"""`jaxmoe convert t5x|hf|gqa|upcycle SRC DST ...`: into jaxmoe, and checkpoint surgery.

Each prints one JSON line describing DST.
"""

import argparse
import json
import math
import time
from pathlib import Path

from jaxmoe.checkpoints.dtypes import OUTPUT_DTYPES
from jaxmoe.cli.flags import add_override_flag, non_negative_int, positive_int
from jaxmoe.conversions.choices import HF_FAMILIES, METHODS
from jaxmoe.errors import ConfigError
from jaxmoe.storage.paths import absolute_path

# Each run_* imports its converter: `jaxmoe convert --help` must not start JAX.


def add_parser(subparsers) -> None:
    """Registers `jaxmoe convert` and its formats."""
    convert = subparsers.add_parser(
        "convert", help="convert checkpoints into jaxmoe (t5x, hf), GQA pooling, upcycling"
    )
    formats = convert.add_subparsers(dest="format", required=True)
    _add_t5x(formats)
    _add_hf(formats)
    _add_surgery(formats)


def _add_t5x(subparsers) -> argparse.ArgumentParser:
    """Registers `t5x` under the `jaxmoe convert` subcommands."""
    parser = subparsers.add_parser(
        "t5x",
        help="T5X T5 or MoE (Switch Transformer) checkpoint -> jaxmoe checkpoint",
        description=(
            "Convert a T5X checkpoint (legacy msgpack, TensorStore, Orbax or OCDBT) of a T5 "
            "encoder-decoder (T5.1.1, T5 v1.0), dense or with Flaxformer MoE layers (Switch "
            "Transformer). The architecture is inferred from the tensors; --config.KEY=VALUE "
            "overrides are stored in DST's config (e.g. --config.data.tokenizer=spm.model, "
            "--config.model.moe.gating=adaptive to re-gate a Switch model)."
        ),
    )
    parser.add_argument(
        "src", type=absolute_path, help="T5X checkpoint_<step> directory (or its msgpack file)"
    )
    parser.add_argument("dst", type=absolute_path, help="new jaxmoe checkpoint directory")
    add_override_flag(parser)
    parser.add_argument("--dtype", default="float32", choices=sorted(OUTPUT_DTYPES))
    parser.add_argument(
        "--num_heads", type=positive_int, default=None, help="check against the relpos table"
    )
    parser.add_argument(
        "--head_dim", type=positive_int, default=None, help="default: query width / heads"
    )
    parser.add_argument(
        "--relpos_max_distance",
        type=positive_int,
        default=128,
        help="T5 relative-position max distance (not stored in T5X checkpoints)",
    )
    parser.add_argument(
        "--keep_optimizer",
        action="store_true",
        help="also convert T5X's Adafactor state, so uptraining continues it exactly",
    )
    parser.set_defaults(run=run_t5x)
    return parser


def run_t5x(args) -> int:
    """Runs the conversion for parsed `args`; prints one JSON line describing DST."""
    from jaxmoe.checkpoints.staging import interrupts_in_one_line
    from jaxmoe.conversions.t5x.convert import convert_t5x

    overrides = args.overrides
    start = time.perf_counter()
    with interrupts_in_one_line(args.dst):
        config = convert_t5x(
            args.src,
            args.dst,
            dtype=args.dtype,
            num_heads=args.num_heads,
            head_dim=args.head_dim,
            relpos_max_distance=args.relpos_max_distance,
            overrides=overrides,
            keep_optimizer=args.keep_optimizer,
        )
    m = config.model
    summary = {
        "checkpoint": str(Path(args.dst).absolute()),
        "dtype": args.dtype,
        "vocab_size": m.vocab_size,
        "d_model": m.d_model,
        "layers": [m.num_encoder_layers, m.num_layers],
        "heads": [m.num_heads, m.num_kv_heads, m.head_dim],
        "ffn_dim": m.ffn_dim,
        "experts": m.moe.num_experts,
        "moe_every": m.moe.every if m.moe.num_experts else 0,
        "source_step": config.extra["source"]["step"],
        "seconds": round(time.perf_counter() - start, 2),
    }
    print(json.dumps(summary))
    return 0


def convert_hf_summary(src: str, dst: str, dtype: str = "float32", overrides=()) -> int:
    """`jaxmoe convert hf SRC DST [--dtype] [--config.KEY=VALUE ...]`: prints one JSON line."""
    from jaxmoe.checkpoints.staging import interrupts_in_one_line
    from jaxmoe.checkpoints.trees import flatten
    from jaxmoe.conversions.hf.importer import convert_hf
    from jaxmoe.models.spec import abstract_params
    from jaxmoe.models.stack import unrolled_config

    start = time.perf_counter()
    with interrupts_in_one_line(dst):
        config = convert_hf(src, dst, dtype, overrides)
    m = config.model
    summary = {
        "checkpoint": str(Path(dst).absolute()),
        "arch": m.arch,
        "dtype": dtype,
        "vocab_size": m.vocab_size,
        "d_model": m.d_model,
        "layers": m.num_layers,
        "heads": [m.num_heads, m.num_kv_heads, m.head_dim],
        "experts": [m.moe.num_experts, m.moe.gate.gating] if m.moe.num_experts else 0,
        "parameters": sum(
            math.prod(a.shape) for a in flatten(abstract_params(unrolled_config(m))).values()
        ),
        "seconds": round(time.perf_counter() - start, 2),
    }
    if m.arch == "encoder_decoder":
        summary["layers"] = [m.num_encoder_layers, m.num_layers]
    print(json.dumps(summary))
    return 0


def _add_hf(subparsers) -> argparse.ArgumentParser:
    """Registers `hf` under the `jaxmoe convert` subcommands (runs `run_hf(args)`)."""
    parser = subparsers.add_parser(
        "hf",
        help="Hugging Face safetensors checkpoint -> jaxmoe checkpoint",
        description=(
            "Convert a Hugging Face checkpoint directory (config.json + model.safetensors or "
            "an index of shards) of one of these families (config.json's model_type): "
            + ", ".join(f"{name} ({key})" for key, name in HF_FAMILIES.items())
            + ". Its tokenizer files are kept in DST/tokenizer. "
            "--config.KEY=VALUE overrides are stored in DST's config."
        ),
    )
    parser.add_argument(
        "src", type=absolute_path, help="HF checkpoint directory (what save_pretrained writes)"
    )
    parser.add_argument("dst", type=absolute_path, help="new jaxmoe checkpoint directory")
    add_override_flag(parser)
    parser.add_argument("--dtype", default="float32", choices=sorted(OUTPUT_DTYPES))
    parser.set_defaults(run=run_hf)
    return parser


def run_hf(args) -> int:
    return convert_hf_summary(args.src, args.dst, args.dtype, args.overrides)


def _add_surgery(subparsers) -> None:
    """Register `gqa` and `upcycle` under the `jaxmoe convert` subcommands."""
    gqa = subparsers.add_parser(
        "gqa", help="multi-head -> grouped-query attention (mean-pooled KV heads)"
    )
    gqa.add_argument(
        "src", type=absolute_path, help="jaxmoe checkpoint: workdir, step dir or converted dir"
    )
    gqa.add_argument("dst", type=absolute_path, help="new checkpoint directory")
    gqa.add_argument("--num_kv_heads", type=positive_int, required=True, help="G; 1 = MQA")
    gqa.add_argument("--method", default="mean", choices=METHODS)
    gqa.add_argument(
        "--include_encoder", action="store_true", help="also pool encoder self-attention"
    )
    gqa.add_argument("--seed", type=non_negative_int, default=0, help="for --method=random")
    gqa.set_defaults(run=run_gqa)

    upcycle = subparsers.add_parser(
        "upcycle", help="dense -> MoE: FFN copies (or random experts) + fresh routers"
    )
    upcycle.add_argument("src", type=absolute_path, help="dense jaxmoe checkpoint")
    upcycle.add_argument("dst", type=absolute_path, help="new checkpoint directory")
    upcycle.add_argument("--num_experts", type=positive_int, required=True)
    upcycle.add_argument("--every", type=positive_int, default=1, help="MoE in every K-th layer")
    upcycle.add_argument("--gating", default=None, help="model.moe.gating of the MoE model")
    upcycle.add_argument(
        "--seed", type=non_negative_int, default=0, help="router (and --init random) draws"
    )
    upcycle.add_argument(
        "--init",
        default="copy",
        choices=("copy", "random"),
        help="experts: copies of the dense FFN, or randomly initialised (the adaptive-gating "
        "paper's MoE models from dense ones)",
    )
    upcycle.set_defaults(run=run_upcycle)


def _summary(dst: str, config, start: float) -> None:
    m = config.model
    print(
        json.dumps(
            {
                "checkpoint": str(Path(dst).absolute()),
                "num_heads": m.num_heads,
                "num_kv_heads": m.num_kv_heads,
                "encoder_num_kv_heads": m.encoder_num_kv_heads,
                "num_experts": m.moe.num_experts,
                "moe_every": m.moe.every,
                "gating": m.moe.gate.gating,
                "seconds": round(time.perf_counter() - start, 2),
            }
        )
    )


def _no_overrides(args, command: str) -> None:
    """Surgery keeps SRC's config but for the keys it changes: an override would be lost."""
    if args.overrides:
        raise ConfigError(
            f"convert {command} takes no --config overrides (got {args.overrides[0]!r}): "
            f"it keeps SRC's config; set keys when you train from DST"
        )


def run_gqa(args) -> int:
    _no_overrides(args, "gqa")
    from jaxmoe.checkpoints.staging import interrupts_in_one_line
    from jaxmoe.conversions.surgery import convert_gqa

    start = time.perf_counter()
    with interrupts_in_one_line(args.dst):
        config = convert_gqa(
            args.src, args.dst, args.num_kv_heads, args.method, args.include_encoder, args.seed
        )
    _summary(args.dst, config, start)
    return 0


def run_upcycle(args) -> int:
    _no_overrides(args, "upcycle")
    from jaxmoe.checkpoints.staging import interrupts_in_one_line
    from jaxmoe.conversions.surgery import convert_upcycle

    start = time.perf_counter()
    with interrupts_in_one_line(args.dst):
        config = convert_upcycle(
            args.src, args.dst, args.num_experts, args.every, args.gating, args.seed, args.init
        )
    _summary(args.dst, config, start)
    return 0
