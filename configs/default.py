"""Default main job: a small adaptive-gating MoE LM on the embedded corpus (~5 min, 2 cores).

Run:   jaxmoe train --config configs/default.py --workdir runs/default
Variants (same model, other FFN/gate):  configs/default.py:top1 | :top2 | :dense
Override any key:  --config.train.steps=100 --config.model.moe.threshold=0.2
"""

from ml_collections import ConfigDict

from jaxmoe.config.defaults import base_config

VARIANTS = ("dense", "top1", "top2", "adaptive", "top_p")


def get_config(variant: str | None = None) -> ConfigDict:
    c = base_config()  # every key: `python -m jaxmoe.config` (docs/configs.md)
    if variant:
        _apply_variant(c, variant)
    return c


def _apply_variant(c: ConfigDict, variant: str) -> None:
    if variant == "dense":
        c.model.moe.num_experts = 0
    elif variant in VARIANTS:
        c.model.moe.gating = variant
    else:
        raise ValueError(f"configs/default.py: unknown variant {variant!r} ({'|'.join(VARIANTS)})")
