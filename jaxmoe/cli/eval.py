"""`jaxmoe eval --checkpoint C --data D`: score data (loss, perplexity, accuracy) or generate
and score generations (`--task generate`), sharded on the mesh."""

import json

from jaxmoe.cli.flags import (
    add_checkpoint_flags,
    add_distributed_flags,
    add_sampling_flags,
    checkpoint_config_override,
    initialize_from_flags,
    non_negative_float,
    non_negative_int,
    positive_int,
    writable_file,
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="score data with a checkpoint, sharded on the mesh")
    add_checkpoint_flags(parser)
    parser.add_argument("--per_example", action="store_true", help="add per-example losses")
    parser.add_argument(
        "--record_routing",
        type=writable_file,
        default=None,
        metavar="FILE",
        help="write each sequence's chosen experts per MoE layer (a safetensors routing "
        "record, docs/post_training.md); jsonl:FILE data",
    )
    parser.add_argument(
        "--truncate",
        action="store_true",
        help="score examples longer than the model's context by their first tokens; "
        "--task generate: keep an input's last tokens (logged)",
    )
    parser.add_argument(
        "--task",
        choices=["score", "generate"],
        default="score",
        help="score: loss/perplexity/accuracy; generate: ROUGE/BLEU/EM/F1 of generations",
    )
    add_generate_flags(parser)
    add_distributed_flags(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    from jaxmoe.inference.evaluate import evaluate

    if args.task == "generate" and args.record_routing:
        raise ValueError("--record_routing records --task score's pass (decode records its own)")
    if args.task == "score" and args.output:
        raise ValueError(
            "--output writes --task generate's predictions; --task score prints its result "
            "(with --per_example, the loss of every example)"
        )
    initialize_from_flags(args)
    config = checkpoint_config_override(args)
    if args.task == "generate":
        result = _generate(args, config, args.overrides)
    else:
        result = evaluate(
            args.checkpoint,
            args.data,
            config=config,
            per_example=args.per_example,
            overrides=args.overrides,
            truncate=args.truncate,
            record_routing=args.record_routing,
        )
    print(json.dumps(result))
    return 0


def add_generate_flags(parser) -> None:
    """`jaxmoe eval` flags used with --task generate."""
    group = parser.add_argument_group("--task generate")
    group.add_argument("--max_new_tokens", type=positive_int, default=64)
    group.add_argument("--num_beams", type=positive_int, default=1, help="1 = greedy or sampling")
    group.add_argument(
        "--length_penalty", type=non_negative_float, default=0.6, help="T5X's beam-search alpha"
    )
    add_sampling_flags(group)
    group.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="a stop string (repeatable): predictions are cut before it and, when sampling "
        "or greedy, a row stops generating once it is safe to",
    )
    group.add_argument(
        "--batch_size",
        type=non_negative_int,
        default=0,
        help="prompts per batch (0 = train.batch_size)",
    )
    group.add_argument(
        "--output", type=writable_file, default=None, help="per-example predictions (jsonl)"
    )


def _generate(args, config, overrides) -> dict:
    if args.per_example:
        raise ValueError("--per_example is for --task score; --task generate writes --output")
    from jaxmoe.inference.generate_eval import generate_eval

    return generate_eval(
        args.checkpoint,
        args.data,
        max_new_tokens=args.max_new_tokens,
        num_beams=args.num_beams,
        length_penalty=args.length_penalty,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_strings=tuple(args.stop),
        batch_size=args.batch_size,
        output=args.output,
        config=config,
        overrides=overrides,
        truncate=args.truncate,
    )
