"""`jaxmoe export hf ADAPTERS DST --peft`: a LoRA checkpoint's adapters as a PEFT adapter
folder (`adapter_config.json` + `adapter_model.safetensors`) that
`peft.PeftModel.from_pretrained` loads onto the transformers model `export hf` writes for the
merged model (the base exported alone gives the same model).

PEFT's format (peft 0.17+; read from its LoraConfig and its LoRA layers):
- a linear module M (attention q/k/v/o, dense or shared-expert FFN projections) is named in
  `target_modules`; its tensors `base_model.model.M.lora_A.weight` [r, in] and
  `...lora_B.weight` [out, r], delta = lora_B @ lora_A * lora_alpha / r on HF's [out, in];
- a parameter P that is not a Linear (transformers 5's fused experts `mlp.experts.gate_up_proj`
  [E, 2F, D] / `down_proj` [E, D, F], the router's `mlp.gate.weight` [E, D]) is named in
  `target_parameters` and wrapped by PEFT's ParamWrapper: lora_A.weight [r * E, in] holds
  expert e's A in rows e * r..e * r + r, lora_B.weight [out, r * E] holds its B in columns
  k * E + e (rank outer, experts inner), and in/out are the expert matrix's [in, out]
  (swapped from the stored (E, out, in)). Two parameters of one module nest: the first
  wrapped (gate_up_proj, declared first) is the inner `base_layer`, so its tensors sit at
  `mlp.experts.base_layer.lora_*`, down_proj's at `mlp.experts.lora_*`.
jaxmoe adapts the gate (wi_0) and the up projection (wi_1) apart, each of rank r; fused
they are one adapter of rank 2r whose A stacks both and whose B is block diagonal, written
with that rank and alpha * 2 in `rank_pattern` / `alpha_pattern`, so the scale is the same.
"""

import json
from pathlib import Path

import numpy as np

from jaxmoe.checkpoints.dtypes import output_dtype
from jaxmoe.checkpoints.leafwise import StoredParams
from jaxmoe.checkpoints.staging import staged_directory
from jaxmoe.checkpoints.trees import flatten
from jaxmoe.config.stored import read_config
from jaxmoe.conversions.hf.export_config import export_plan
from jaxmoe.conversions.hf.exporter import write_safetensors
from jaxmoe.conversions.hf.names import Linear
from jaxmoe.errors import CheckpointError
from jaxmoe.models.layers import LORA_A, LORA_B
from jaxmoe.models.lora import adapted_name, is_adapter
from jaxmoe.models.spec import abstract_params
from jaxmoe.models.stack import stacked_location, unrolled_config

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def export_peft(ckpt_path: str, dst_dir: str, dtype: str = "float32") -> dict:
    """Writes the PEFT adapter folder of LoRA checkpoint `ckpt_path` to `dst_dir`; returns
    the adapter config."""
    config = read_config(ckpt_path, tokenizer=False)
    lora = config.train.lora
    if not lora.enabled:
        raise CheckpointError(
            f"checkpoint {ckpt_path!r} holds no LoRA adapters: `export hf` without --peft "
            "writes the model"
        )
    m = config.model
    hf_config, maps = export_plan(m, max_positions=max(2048, config.train.seq_len, m.max_len))
    if hf_config["model_type"] == "jaxmoe_moe":
        raise CheckpointError(
            "--peft: this model exports as jaxmoe_moe (trust_remote_code), which PEFT's expert "
            "parameters do not describe; export the merged model (--base CKPT)"
        )
    stored = StoredParams(ckpt_path)
    layers = flatten(abstract_params(unrolled_config(m), lora))
    adapters = {p: a for p, a in layers.items() if is_adapter(p)}
    others = [p for p in stored.paths if not is_adapter(p)]
    if others:
        raise CheckpointError(
            f"--peft: the checkpoint also trains {'/'.join(others[0])} in full "
            f"(train.trainable); export the merged model (--base CKPT) instead"
        )
    stacked = any(p[1] in ("period", "head", "tail") for p in stored.paths if len(p) > 1)

    def read(path):
        where, row = stacked_location(path, m) if stacked else (path, None)
        return stored.read(where, () if row is None else (row,)).astype(np.float32)

    by_path = {t.path: t for t in maps if t.expert in (None, 0)}
    tensors, modules, parameters, ranks = {}, [], [], {}
    weights = sorted({(*p[:-1], adapted_name(p)) for p in adapters})
    by_layer_experts: dict[tuple, set] = {}
    for weight in weights:
        t = by_path.get(weight)
        if t is None:
            raise CheckpointError(f"--peft: {'/'.join(weight)} has no Hugging Face counterpart")
        if t.expert is not None:  # an expert stack: written per MoE layer below
            by_layer_experts.setdefault(weight[:-1], set()).add(weight[-1])
            continue
        if not isinstance(t.layout, Linear):
            raise CheckpointError(f"--peft: {t.hf_name} is not a linear weight")
        a, b = read((*weight[:-1], weight[-1] + LORA_A)), read((*weight[:-1], weight[-1] + LORA_B))
        module = t.hf_name.removesuffix(".weight")
        rank = a.shape[-1]
        lora_a = a.reshape(-1, rank).T  # [r, in]
        lora_b = b.reshape(rank, -1).T  # [out, r]
        if weight[-1] == "router":  # a Parameter of the router module, not a Linear
            parameters.append(t.hf_name)
        else:
            modules.append(module)
        tensors[f"{PREFIX}{module}.lora_A.weight"] = lora_a
        tensors[f"{PREFIX}{module}.lora_B.weight"] = lora_b
    for ffn, names in sorted(by_layer_experts.items()):
        router = by_path[(*ffn, "router")].hf_name  # model.layers.{i}.mlp.gate.weight
        experts = router.removesuffix("gate.weight") + "experts"
        fused = [n for n in ("wi_0", "wi_1") if n in names]
        nested = bool(fused) and "wo" in names
        if fused:
            name = f"{experts}.gate_up_proj"
            lora_a, lora_b = _fused_gate_up(ffn, fused, read, lora.rank)
            inner = ".base_layer" if nested else ""
            tensors[f"{PREFIX}{experts}{inner}.lora_A.weight"] = lora_a
            tensors[f"{PREFIX}{experts}{inner}.lora_B.weight"] = lora_b
            parameters.append(name)
            ranks[name] = 2 * lora.rank  # both halves' slots, a missing one left zero
        if "wo" in names:
            a, b = read((*ffn, "wo" + LORA_A)), read((*ffn, "wo" + LORA_B))
            # A [E, F, r] -> rows e * r + k of [r * E, F]; B [E, r, D] -> [D, r * E], col k * E + e
            down = f"{PREFIX}{experts}.lora_"
            tensors[down + "A.weight"] = a.transpose(0, 2, 1).reshape(-1, a.shape[1])
            tensors[down + "B.weight"] = b.transpose(2, 1, 0).reshape(b.shape[2], -1)
            parameters.append(f"{experts}.down_proj")
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules or None,
        "target_parameters": parameters or None,
        "rank_pattern": ranks,
        "alpha_pattern": {name: lora.alpha * r / lora.rank for name, r in ranks.items()},
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    out = output_dtype(dtype)
    shapes = {name: tuple(x.shape) for name, x in tensors.items()}
    dst = Path(dst_dir)
    with staged_directory(dst) as staging:
        staging.mkdir()
        write_safetensors(
            staging / ADAPTER_WEIGHTS,
            shapes,
            dtype,
            lambda n: np.ascontiguousarray(tensors[n].astype(out)),
        )
        (staging / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return adapter_config


def _fused_gate_up(ffn: tuple, fused: list[str], read, rank: int):
    """(lora_A [E * R, D], lora_B [2F, R * E]) of transformers' fused gate_up_proj from the
    gate's and the up projection's adapters (A [E, D, r], B [E, r, F]), R = 2r: A stacked,
    B block diagonal (an adapter left out contributes zeros)."""
    parts = {n: (read((*ffn, n + LORA_A)), read((*ffn, n + LORA_B))) for n in fused}
    a0, b0 = next(iter(parts.values()))
    experts, dim, ffn_dim = a0.shape[0], a0.shape[1], b0.shape[2]
    wide = 2 * rank
    a_fused = np.zeros((experts, wide, dim), np.float32)  # [E, R, D]
    b_fused = np.zeros((experts, 2 * ffn_dim, wide), np.float32)  # [E, 2F, R]
    for slot, name in enumerate(("wi_0", "wi_1")):
        if name not in parts:
            continue
        a, b = parts[name]
        a_fused[:, slot * rank : (slot + 1) * rank] = a.transpose(0, 2, 1)
        rows = slice(slot * ffn_dim, (slot + 1) * ffn_dim)
        b_fused[:, rows, slot * rank : (slot + 1) * rank] = b.transpose(0, 2, 1)
    lora_a = a_fused.reshape(experts * wide, dim)
    lora_b = b_fused.transpose(1, 2, 0).reshape(2 * ffn_dim, wide * experts)
    return lora_a, lora_b
