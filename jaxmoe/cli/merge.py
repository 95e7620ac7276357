"""`jaxmoe merge ADAPTERS --base BASE DST`: a LoRA checkpoint's adapters folded into its base,
written as a whole checkpoint (conversions/lora_merge.py)."""

import json
import time

from jaxmoe.errors import CheckpointError
from jaxmoe.storage.paths import absolute_path


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "merge",
        help="fold a LoRA checkpoint's adapters into its base: a whole checkpoint",
        description=(
            "Write W + alpha / r A B for every adapted weight (float32) as a parameters-only "
            "checkpoint with the adapters' config (train.lora.rank=0) and tokenizer; the "
            "base must be the one the adapters were trained on (its fingerprint is checked)."
        ),
    )
    parser.add_argument("adapters", type=absolute_path, help="LoRA checkpoint (step or workdir)")
    parser.add_argument("dst", type=absolute_path, help="new checkpoint directory")
    parser.add_argument(
        "--base", type=absolute_path, required=True, help="the base checkpoint (train.init_from)"
    )
    parser.set_defaults(run=run)


def run(args) -> int:
    from jaxmoe.checkpoints.staging import check_new_directory, interrupts_in_one_line
    from jaxmoe.conversions.lora_merge import merge_lora

    if args.overrides:
        raise CheckpointError(f"merge takes no --config overrides (got {args.overrides[0]!r})")
    check_new_directory(args.dst)
    start = time.perf_counter()
    with interrupts_in_one_line(args.dst):
        summary = merge_lora(args.adapters, args.base, args.dst)
    print(json.dumps(summary | {"seconds": round(time.perf_counter() - start, 2)}))
    return 0
