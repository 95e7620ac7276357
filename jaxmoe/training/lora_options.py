"""The `train.lora` config section (LoRA adapters on a frozen base, models/lora.py and
training/lora_run.py): its keys' types, defaults, one-line docs and checks."""

from dataclasses import dataclass
from typing import Literal

from jaxmoe.fields import Options, check_choices, need, option
from jaxmoe.models.lora import ADAPTABLE_GROUPS, ADAPTED_INPUTS, MERGED_GROUPS
from jaxmoe.models.param_groups import GROUPS


@dataclass(frozen=True)
class LoraOptions(Options):
    """train.lora: low-rank adapters on a frozen base (docs/post_training.md)."""

    rank: int = option(0, "adapter rank r (0 = off: every parameter trains)")
    alpha: float = option(16.0, "the adapters' product is scaled by alpha / rank")
    dropout: float = option(
        0.0, "dropout on the adapters' input in training (dense projections; not experts/router)"
    )
    targets: str = option(
        "attention,experts",
        "comma list of groups (attention | dense_ffn | experts | shared_experts | router) "
        "and/or glob patterns on per-layer weight paths (layers/*/attn/query) or names (wo)",
    )
    base_dtype: Literal["auto", "bfloat16", "float32"] = option(
        "auto",
        "the frozen base's projection weights in memory: auto (model.dtype) | bfloat16 | "
        "float32 (norms, router, biases stay float32)",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def target_list(self) -> tuple[str, ...]:
        return tuple(part.strip() for part in self.targets.split(",") if part.strip())

    def __post_init__(self) -> None:
        check_choices(self, "train.lora.")
        need(self.rank >= 0, f"train.lora.rank={self.rank} must be >= 0 (0 = off)")
        if not self.enabled:
            return
        need(self.alpha > 0, f"train.lora.alpha={self.alpha} must be > 0")
        need(0 <= self.dropout < 1, f"train.lora.dropout={self.dropout} not in [0, 1)")
        targets = self.target_list()
        need(bool(targets), "train.lora.targets is empty: name groups or weight patterns")
        for target in targets:
            need(
                target not in GROUPS or target in ADAPTABLE_GROUPS,
                f"train.lora.targets: group {target!r} has no matrices to adapt "
                f"({' | '.join(ADAPTABLE_GROUPS)})",
            )
            plain_name = target.isidentifier() and target not in ADAPTABLE_GROUPS
            need(
                not plain_name or target in ADAPTED_INPUTS,
                f"train.lora.targets: {target!r} is neither a group "
                f"({' | '.join(ADAPTABLE_GROUPS)}) nor an adaptable weight "
                f"({' | '.join(ADAPTED_INPUTS)}) nor a path pattern (layers/*/attn/query)",
            )
        merged = [t for t in targets if t in MERGED_GROUPS]
        need(
            not (self.dropout and merged),
            f"train.lora.dropout={self.dropout} with targets {', '.join(merged)}: expert and "
            "router adapters are added to the weight, so their input cannot be dropped alone; "
            "set train.lora.dropout=0 or leave them out",
        )
