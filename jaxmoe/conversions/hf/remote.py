"""MoE routing that stock Mixtral cannot express, exported with a modeling file of its own.

Mixtral routes every token to its top-k experts with renormalised weights. jaxmoe's other
gates (adaptive, top-p, top-k with raw probabilities, a single expert weighted by its
probability) are exported as model_type `jaxmoe_moe`: Mixtral's config and tensor names,
plus `jaxmoe_gate` (the gate options) and an `auto_map` naming `modeling_jaxmoe_moe.py`,
a copy of the module of that name beside this one (transformers runs it with
`trust_remote_code=True`). See docs/hf_interop.md.
"""

import dataclasses
import shutil
from pathlib import Path

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.config.schema import as_type
from jaxmoe.errors import ConfigError
from jaxmoe.fields import as_dict, value_type
from jaxmoe.models.moe.gates import GateOptions
from jaxmoe.models.options import MoEOptions

MODEL_TYPE = "jaxmoe_moe"
MODELING_FILE = "modeling_jaxmoe_moe.py"
_SOURCE = Path(__file__).with_name(MODELING_FILE)
_SLOTS = {"top1": 1, "top2": 2, "adaptive": 2}


def stock_top_k(gate: GateOptions) -> int | None:
    """k when stock Mixtral computes exactly what jaxmoe's `gate` does, else None."""
    if gate.gating not in ("top1", "top2", "topk"):
        return None
    k = _SLOTS.get(gate.gating, gate.top_k)
    if k == 1:  # one expert: Mixtral's renormalised weight p / p is 1
        return k if gate.single_weight == "one" else None
    return k if gate.renormalize else None


def gate_options(gate: GateOptions) -> dict:
    """`jaxmoe_gate` in config.json: what the modeling file's router reads."""
    return as_dict(gate)


def import_gate(hf: dict, moe: dict) -> None:
    """The model.moe keys `moe` routed as `jaxmoe_gate` of config.json `hf` says (convert hf
    of an export), each value of the type its key has (the values themselves are checked
    with the model section: gates.GateOptions)."""
    gate = hf.get("jaxmoe_gate")
    fields = {f.name: f for f in dataclasses.fields(GateOptions)}
    if not isinstance(gate, dict) or set(gate) != set(fields):
        raise CheckpointError(
            f"config.json: jaxmoe_gate={gate!r} must be an object with keys {sorted(fields)}"
        )
    for key, value in gate.items():
        try:
            moe[key] = as_type(f"config.json: jaxmoe_gate.{key}", value, value_type(fields[key]))
        except ConfigError as error:
            raise CheckpointError(str(error)) from None


def remote_fields(moe: MoEOptions, gate: GateOptions) -> dict:
    """config.json keys of a `jaxmoe_moe` model routed by `gate`."""
    gating = gate.gating
    slots = {"topk": gate.top_k, "top_p": gate.max_k}.get(gating, _SLOTS.get(gating))
    module = MODELING_FILE.removesuffix(".py")
    return {
        "architectures": ["JaxmoeMoeForCausalLM"],
        "model_type": MODEL_TYPE,
        "auto_map": {
            "AutoConfig": f"{module}.JaxmoeMoeConfig",
            "AutoModelForCausalLM": f"{module}.JaxmoeMoeForCausalLM",
        },
        "num_experts_per_tok": min(slots, moe.num_experts),
        "jaxmoe_gate": gate_options(gate),
    }


def write_modeling_file(hf_config: dict, dst: Path) -> None:
    """Copies the modeling file into the export `dst` when `hf_config` names it."""
    if hf_config.get("model_type") == MODEL_TYPE:
        shutil.copyfile(_SOURCE, dst / MODELING_FILE)
