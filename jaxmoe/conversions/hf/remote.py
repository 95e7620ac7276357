"""MoE routing that stock Mixtral cannot express, exported with a modeling file of its own.

Mixtral routes every token to its top-k experts with renormalised weights. jaxmoe's other
gates (adaptive, top-p, top-k with raw probabilities, a single expert weighted by its
probability) are exported as model_type `jaxmoe_moe`: Mixtral's config and tensor names,
plus `jaxmoe_gate` (the gate options) and an `auto_map` naming `modeling_jaxmoe_moe.py`,
a copy of the module of that name beside this one (transformers runs it with
`trust_remote_code=True`). See docs/hf_interop.md.
"""

import shutil
from pathlib import Path

from ml_collections import ConfigDict

from jaxmoe.checkpoints.manager import CheckpointError

MODEL_TYPE = "jaxmoe_moe"
MODELING_FILE = "modeling_jaxmoe_moe.py"
_SOURCE = Path(__file__).with_name(MODELING_FILE)
_SLOTS = {"top1": 1, "top2": 2, "adaptive": 2}


def stock_top_k(moe: ConfigDict, gating: str) -> int | None:
    """k when stock Mixtral computes exactly what jaxmoe's `gating` does, else None."""
    if gating not in ("top1", "top2", "topk"):
        return None
    k = _SLOTS.get(gating, int(moe.top_k))
    if k == 1:  # one expert: Mixtral's renormalised weight p / p is 1
        return k if moe.single_weight == "one" else None
    return k if moe.renormalize else None


def gate_options(moe: ConfigDict, gating: str) -> dict:
    """`jaxmoe_gate` in config.json: what the modeling file's router reads."""
    return {
        "gating": gating,
        "threshold": float(moe.threshold),
        "gap_normalization": str(moe.gap_normalization),
        "top_k": int(moe.top_k),
        "top_p": float(moe.top_p),
        "max_k": int(moe.max_k),
        "renormalize": bool(moe.renormalize),
        "single_weight": str(moe.single_weight),
    }


def import_gate(hf: dict, moe: ConfigDict) -> None:
    """`moe` (model.moe) routed as `jaxmoe_gate` of config.json `hf` says (convert hf of an
    export); the values are checked where the model is built (gates.GateConfig)."""
    gate = hf.get("jaxmoe_gate")
    expected = set(gate_options(moe, "top2"))
    if not isinstance(gate, dict) or set(gate) != expected:
        raise CheckpointError(
            f"config.json: jaxmoe_gate={gate!r} must be an object with keys {sorted(expected)}"
        )
    for key, value in gate.items():
        try:
            moe[key] = value
        except TypeError:  # ConfigDict keeps each field's type
            raise CheckpointError(f"config.json: jaxmoe_gate.{key}={value!r}") from None


def remote_fields(moe: ConfigDict, gating: str) -> dict:
    """config.json keys of a `jaxmoe_moe` model routed by `gating`."""
    slots = {"topk": int(moe.top_k), "top_p": int(moe.max_k)}.get(gating, _SLOTS.get(gating))
    module = MODELING_FILE.removesuffix(".py")
    return {
        "architectures": ["JaxmoeMoeForCausalLM"],
        "model_type": MODEL_TYPE,
        "auto_map": {
            "AutoConfig": f"{module}.JaxmoeMoeConfig",
            "AutoModelForCausalLM": f"{module}.JaxmoeMoeForCausalLM",
        },
        "num_experts_per_tok": min(slots, int(moe.num_experts)),
        "jaxmoe_gate": gate_options(moe, gating),
    }


def write_modeling_file(hf_config: dict, dst: Path) -> None:
    """Copies the modeling file into the export `dst` when `hf_config` names it."""
    if hf_config.get("model_type") == MODEL_TYPE:
        shutil.copyfile(_SOURCE, dst / MODELING_FILE)
