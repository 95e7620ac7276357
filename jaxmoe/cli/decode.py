"""`jaxmoe decode --checkpoint PATH --prompt TEXT`: generate text with a KV cache, sharded."""

import argparse

from jaxmoe.cli.flags import (
    add_checkpoint_flags,
    add_sampling_flags,
    checkpoint_config_override,
    positive_int,
    writable_file,
)
from jaxmoe.inference.choices import SPECULATIVE
from jaxmoe.storage.paths import absolute_path


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `jaxmoe decode` on the CLI's subparsers; it runs `run`."""
    parser = subparsers.add_parser("decode", help="generate text with a KV cache, sharded")
    add_checkpoint_flags(parser, data=False)
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", help="one prompt")
    prompts.add_argument(
        "--prompts_file", type=absolute_path, help="a text file, one prompt per non-empty line"
    )
    parser.add_argument("--max_new_tokens", type=positive_int, default=64)
    add_sampling_flags(parser)
    parser.add_argument(
        "--speculative",
        choices=SPECULATIVE,
        default="",
        help="mtp: greedy decoding drafted by the model's multi-token-prediction module "
        "(model.mtp_depth > 0); the output equals plain greedy decoding",
    )
    parser.add_argument(
        "--record_routing",
        type=writable_file,
        default=None,
        metavar="FILE",
        help="write the experts every prompt and new token ran through, per MoE layer (a "
        "safetensors routing record for router replay, docs/post_training.md)",
    )
    parser.add_argument(
        "--truncate",
        action="store_true",
        help="cut prompts longer than the model's context to their last tokens (logged)",
    )
    parser.set_defaults(run=run)
    return parser


def run(args) -> int:
    from jaxmoe.inference.decode_text import decode_main

    overrides = args.overrides
    config = checkpoint_config_override(args)
    decode_main(
        args.checkpoint,
        prompt=args.prompt,
        prompts_file=args.prompts_file,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        overrides=overrides,
        config=config,
        truncate=args.truncate,
        speculative=args.speculative,
        record_routing=args.record_routing,
    )
    return 0
