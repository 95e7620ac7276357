"""Default main job: a small adaptive-gating MoE LM on the embedded corpus (~5 min, 2 cores).

Run:   jaxmoe train --config configs/default.py --workdir runs/default
Variants (same model, other FFN/gate):  configs/default.py:top1 | :top2 | :dense
Override any key:  --config.train.steps=100 --config.model.moe.threshold=0.2

A departure from the adaptive-gating paper, kept on purpose: the router z-loss of the base
config (model.moe.z_loss_weight = 0.001, ST-MoE's stabiliser) stays on; the paper used none.
Its paper-faithful jobs turn it off (configs/moe16_gpt2_medium.py, the benchmarks), and so
does `--config.model.moe.z_loss_weight=0`; docs/paper_readings.md measures the difference.
"""

from ml_collections import ConfigDict

from jaxmoe.config.defaults import base_config

VARIANTS = ("dense", "top1", "top2", "adaptive", "top_p")


def get_config(variant: str | None = None) -> ConfigDict:
    c = base_config()  # every key: `jaxmoe config` (docs/configs.md)
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
