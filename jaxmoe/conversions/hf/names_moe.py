"""Qwen3-MoE, Qwen2-MoE and OLMoE config.json -> jaxmoe model config (`convert hf`).

The three share Llama's layout plus a softmax top-k router (`mlp.gate`) over experts named
`mlp.experts.{e}.{gate,up,down}_proj` (transformers 5.x keeps them fused in memory as
`gate_up_proj` [E, 2F, D] / `down_proj` [E, D, F], and save_pretrained writes them per
expert); names.py holds the tensor table. What differs:

- Qwen3-MoE: RMSNorm over each query/key head before rotary (`model.qk_norm=head`); dense
  layers from `decoder_sparse_step` / `mlp_only_layers`.
- Qwen2-MoE: q/k/v biases, and one always-on shared expert scaled by sigmoid(x @ w)
  (`model.moe.num_shared_experts=1`, `shared_expert_gate`); dense layers as Qwen3-MoE.
- OLMoE: RMSNorm over the whole query and key projections (`model.qk_norm=projection`);
  an MoE FFN of width `intermediate_size` in every layer.

Every routing choice maps to jaxmoe exactly; a config field jaxmoe cannot compute is refused
in one line naming it. The reverse direction is export_moe.py.
"""

import re

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.conversions.hf.hf_config import (
    ModelKeys,
    check_layer_count,
    config_number,
    config_size,
    read_decoder_basics,
)

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe")
QK_NORM = {"qwen3_moe": "head", "qwen2_moe": "none", "olmoe": "projection"}


def _flag(hf: dict, key: str, default: bool) -> bool:
    value = hf.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"config.json: {key}={value!r} is not true or false")
    return value


def _refuse_unsupported(hf: dict, family: str) -> None:
    """The fields of these families that change what the model computes and that jaxmoe
    does not implement."""
    if family != "qwen2_moe" and _flag(hf, "attention_bias", False):
        raise CheckpointError(
            "config.json: attention_bias=true: jaxmoe has q/k/v biases but no "
            "output-projection bias"
        )
    if family == "olmoe" and hf.get("clip_qkv") is not None:
        raise CheckpointError(
            f"config.json: clip_qkv={hf['clip_qkv']!r}: jaxmoe does not clip queries, keys "
            "and values"
        )


def _num_experts(hf: dict) -> int:
    """Qwen3-MoE's config writes `num_local_experts` (an alias of num_experts)."""
    keys = [k for k in ("num_experts", "num_local_experts") if hf.get(k) is not None]
    if len(keys) == 2 and hf["num_experts"] != hf["num_local_experts"]:
        raise CheckpointError(
            f"config.json: num_experts={hf['num_experts']!r} and num_local_experts="
            f"{hf['num_local_experts']!r} disagree; keep one"
        )
    return config_size(hf, keys[0] if keys else "num_experts")


def _dense_layers(hf: dict, num_layers: int) -> str:
    """`mlp_only_layers` as model.moe.dense_layers ("0,3"): layer ids within the model."""
    layers = hf.get("mlp_only_layers") or []
    if not isinstance(layers, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in layers
    ):
        raise CheckpointError(
            f"config.json: mlp_only_layers={layers!r} must list layer ids in 0..{num_layers - 1}"
        )
    return ",".join(str(i) for i in sorted(set(layers)))


def _expert_style(present: set[str], m: ModelKeys) -> str:
    """`fused` (transformers 5.x in-memory names) or `per_expert` (save_pretrained's), with
    the expert count checked against the first MoE layer's tensors."""
    if any(n.endswith(".experts.gate_up_proj") for n in present):
        return "fused"
    layers = {
        int(x.group(1)) for n in present if (x := re.match(r"model\.layers\.(\d+)\.mlp\.gate\.", n))
    }
    if layers:
        first = min(layers)
        pattern = rf"model\.layers\.{first}\.mlp\.experts\.(\d+)\.gate_proj\."
        check_layer_count(present, pattern, "num_experts", m["moe"]["num_experts"])
    return "per_expert"


def read_moe_family(hf: dict, present: set[str], m: ModelKeys) -> str:
    """Sets model config `m` from a Qwen3-MoE / Qwen2-MoE / OLMoE config.json `hf` (tensor
    names `present`); returns the experts' tensor style for names.decoder_maps."""
    family = hf["model_type"]
    _refuse_unsupported(hf, family)
    m["qkv_bias"] = family == "qwen2_moe" and _flag(hf, "qkv_bias", True)
    read_decoder_basics(hf, present, m)
    m["qk_norm"] = QK_NORM[family]
    if family == "olmoe" and m["num_heads"] * m["head_dim"] != m["d_model"]:
        raise CheckpointError(
            f"config.json: head_dim={m['head_dim']} x num_attention_heads={m['num_heads']} != "
            f"hidden_size={m['d_model']}: OLMoE's query norm spans hidden_size"
        )
    moe = m["moe"]
    moe["num_experts"] = _num_experts(hf)
    k = config_size(hf, "num_experts_per_tok")
    if k > moe["num_experts"]:
        raise CheckpointError(
            f"config.json: num_experts_per_tok={k} exceeds num_experts={moe['num_experts']}"
        )
    if family == "olmoe":  # experts as wide as intermediate_size, in every layer
        moe["ffn_dim"], moe["every"], moe["dense_layers"] = m["ffn_dim"], 1, ""
    else:
        moe["ffn_dim"] = config_size(hf, "moe_intermediate_size")
        moe["every"] = config_size(hf, "decoder_sparse_step", 1)
        moe["dense_layers"] = _dense_layers(hf, m["num_layers"])
    moe["first_dense_layers"] = 0
    # Softmax over all experts, the top k kept; norm_topk_prob divides them by their sum.
    norm = _flag(hf, "norm_topk_prob", False)
    moe["router_scoring"] = "softmax"
    moe["gating"] = {1: "top1", 2: "top2"}.get(k, "topk")
    moe["top_k"] = k
    moe["renormalize"] = norm
    moe["single_weight"] = "one" if norm else "prob"  # k = 1: p / p, or the raw p
    moe["eval_gating"] = ""
    moe["capacity_factor"] = 0.0  # dropless
    moe["jitter"] = 0.0
    moe["balance_loss_weight"] = config_number(hf, "router_aux_loss_coef", 0.0)
    moe["z_loss_weight"] = 0.0  # trained without a router z-loss
    shared = family == "qwen2_moe"
    moe["num_shared_experts"] = 1 if shared else 0
    moe["shared_ffn_dim"] = config_size(hf, "shared_expert_intermediate_size") if shared else 0
    moe["shared_expert_gate"] = shared
    return _expert_style(present, m)
