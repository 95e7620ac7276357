"""GPT-OSS (`model_type: gpt_oss`) <-> jaxmoe, both directions: config keys and tensors.

What GPT-OSS computes and where jaxmoe has it (docs/gpt_oss.md):
- attention: q/k/v and o_proj biases (`model.qkv_bias`, `model.out_bias`), a learned sink
  logit per head (`self_attn.sinks` -> attn/sinks, `model.attention_sinks`), layers typed
  sliding_attention / full_attention (`model.layer_types`, `model.sliding_window`);
- YaRN rotary scaling (`model.rope_type=yarn`, rope_yarn.py), written with truncate=false;
- router: `mlp.router.weight` / `.bias`, top-k of the logits then a softmax over the k
  (= softmax over all experts, top-k, renormalised: `gating=topk`, `renormalize`);
- experts packed per layer: `gate_up_proj` [E, D, 2F] (gate and up columns interleaved,
  2i and 2i + 1) with `gate_up_proj_bias` [E, 2F], `down_proj` [E, F, D] with
  `down_proj_bias` [E, D] (`model.moe.expert_bias`), and the clamped SwiGLU
  (`model.activation=swiglu_clamped`, `swiglu_alpha`, `swiglu_limit`).
"""

from dataclasses import dataclass

import numpy as np

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.conversions.hf.hf_config import (
    ModelKeys,
    config_number,
    config_size,
    model_keys,
    model_options,
    read_decoder_sizes,
    read_rope,
)
from jaxmoe.conversions.hf.names import SAME, ImportPlan, Linear, TensorMap, attention_maps
from jaxmoe.fields import as_dict
from jaxmoe.models.attention_window import SLIDING, parse_layer_types
from jaxmoe.models.options import ModelOptions

MODEL_TYPE = "gpt_oss"
_HF_KIND = {"sliding": "sliding_attention", "full": "full_attention"}


@dataclass(frozen=True)
class InterleavedGateUp:
    """HF `gate_up_proj` [E, D, 2F] (gate columns 2i, up columns 2i + 1) <-> wi_0 (part 0) or
    wi_1 (part 1) [E, D, F]. Export packs both: `to_hf_pair(this, partner)`."""

    part: int

    @property
    def partner(self) -> str:
        return ("wi_1", "wi_0")[self.part]

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], 2 * shape[-1])

    def to_jaxmoe(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return hf[..., self.part :: 2]

    def to_hf_pair(self, mine: np.ndarray, partner: np.ndarray) -> np.ndarray:
        gate, up = (mine, partner) if self.part == 0 else (partner, mine)
        return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)

    to_hf = None


@dataclass(frozen=True)
class InterleavedBias(InterleavedGateUp):
    """HF `gate_up_proj_bias` [E, 2F] <-> wi_0_bias / wi_1_bias [E, F]."""

    @property
    def partner(self) -> str:
        return ("wi_1_bias", "wi_0_bias")[self.part]


def read_gpt_oss(hf: dict, present: set[str], m: ModelKeys) -> None:
    """Sets jaxmoe model config `m` from a GPT-OSS config.json `hf` (tensor names `present`)."""
    read_decoder_sizes(hf, present, m)
    m["norm_eps"] = config_number(hf, "rms_norm_eps")
    _read_yarn(hf, m)
    m["max_len"] = config_size(hf, "max_position_embeddings", 0)
    m["tie_embeddings"] = bool(hf.get("tie_word_embeddings", False)) and (
        "lm_head.weight" not in present
    )
    bias = hf.get("attention_bias", True)
    if bias is not True:
        raise CheckpointError(f"config.json: attention_bias={bias!r}: GPT-OSS has biases")
    m["qkv_bias"] = m["out_bias"] = m["attention_sinks"] = True
    _read_layer_types(hf, m)
    m["activation"] = "swiglu_clamped"
    m["swiglu_alpha"] = config_number(hf, "swiglu_alpha", 1.702)
    m["swiglu_limit"] = config_number(hf, "swiglu_limit", 7.0)
    moe = m["moe"]
    moe["num_experts"] = config_size(hf, "num_local_experts")
    k = config_size(hf, "num_experts_per_tok")
    if k > moe["num_experts"]:
        raise CheckpointError(
            f"config.json: num_experts_per_tok={k} exceeds num_local_experts={moe['num_experts']}"
        )
    m["ffn_dim"] = moe["ffn_dim"] = config_size(hf, "intermediate_size")
    moe["every"], moe["first_dense_layers"], moe["dense_layers"] = 1, 0, ""
    moe["gating"] = {1: "top1", 2: "top2"}.get(k, "topk")
    moe["top_k"], moe["renormalize"], moe["single_weight"], moe["eval_gating"] = k, True, "one", ""
    moe["router_scoring"], moe["router_bias"], moe["expert_bias"] = "softmax", True, True
    moe["capacity_factor"], moe["jitter"], moe["z_loss_weight"] = 0.0, 0.0, 0.0
    moe["balance_loss_weight"] = config_number(hf, "router_aux_loss_coef", 0.0)
    moe["num_shared_experts"] = 0


def _read_yarn(hf: dict, m: ModelKeys) -> None:
    """GPT-OSS's rotary scaling: yarn (or none); the others go through read_rope."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type")) != "yarn":
        read_rope(hf, m)
        return
    m["rope_theta"] = config_number(params if "rope_theta" in params else hf, "rope_theta")
    m["rope_type"] = "yarn"
    m["rope_factor"] = config_number(params, "factor")
    m["rope_original_max_len"] = config_size(params, "original_max_position_embeddings")
    m["rope_beta_fast"] = config_number(params, "beta_fast", 32.0)
    m["rope_beta_slow"] = config_number(params, "beta_slow", 1.0)
    m["rope_attention_factor"] = config_number(params, "attention_factor", 0.0)
    for key in ("mscale", "mscale_all_dim"):
        if params.get(key):
            raise CheckpointError(f"config.json: rope_parameters.{key} with GPT-OSS attention")
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise CheckpointError(f"config.json: rope_parameters.truncate={truncate!r} is no bool")
    m["rope_truncate"] = truncate


def _read_layer_types(hf: dict, m: ModelKeys) -> None:
    types = hf.get("layer_types")
    if types is None:  # GptOssConfig's default: sliding, full, sliding, ...
        types = [("sliding_attention", "full_attention")[i % 2] for i in range(m["num_layers"])]
    if not isinstance(types, list) or len(types) != m["num_layers"]:
        raise CheckpointError(
            f"config.json: layer_types must list num_hidden_layers={m['num_layers']} kinds"
        )
    window = hf.get("sliding_window")
    sliding = "sliding_attention" in types
    if sliding and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise CheckpointError(f"config.json: sliding_window={window!r} is not a positive integer")
    try:
        parse_layer_types(",".join(types), m["num_layers"], 1)
    except ValueError as error:
        raise CheckpointError(f"config.json: layer_types: {error}") from None
    m["sliding_window"] = int(window) if sliding else 0
    m["layer_types"] = ",".join(types) if sliding else ""


def gpt_oss_plan(hf: dict, present: set[str]) -> tuple[ModelOptions, ImportPlan]:
    """names.import_plan for GPT-OSS (importer.py asks here: this module builds on names.py,
    which therefore cannot import it)."""
    m = model_keys()
    read_gpt_oss(hf, present, m)
    model = model_options(m)
    return model, ImportPlan(gpt_oss_maps(model))


def gpt_oss_maps(m: ModelOptions) -> list[TensorMap]:
    """The tensor table of a jaxmoe GPT-OSS model `m` (import and export)."""
    maps = [TensorMap("model.embed_tokens.weight", ("embed", "embedding"), SAME)]
    for i in range(m.num_layers):
        hf, path = f"model.layers.{i}.", ("layers", str(i))
        attn = (*path, "attn")
        maps.append(TensorMap(hf + "input_layernorm.weight", (*path, "attn_norm", "scale"), SAME))
        maps += attention_maps(hf + "self_attn.", attn, "{}_proj.weight", qkv_bias=True)
        maps.append(TensorMap(hf + "self_attn.o_proj.bias", (*attn, "out_bias"), SAME))
        maps.append(TensorMap(hf + "self_attn.sinks", (*attn, "sinks"), SAME))
        maps.append(
            TensorMap(hf + "post_attention_layernorm.weight", (*path, "ffn_norm", "scale"), SAME)
        )
        mlp, ffn = hf + "mlp.", (*path, "ffn")
        experts = mlp + "experts."
        maps += [
            TensorMap(mlp + "router.weight", (*ffn, "router"), Linear(1)),
            TensorMap(mlp + "router.bias", (*ffn, "router_bias"), SAME),
            TensorMap(experts + "gate_up_proj", (*ffn, "wi_0"), InterleavedGateUp(0)),
            TensorMap(experts + "gate_up_proj", (*ffn, "wi_1"), InterleavedGateUp(1)),
            TensorMap(experts + "gate_up_proj_bias", (*ffn, "wi_0_bias"), InterleavedBias(0)),
            TensorMap(experts + "gate_up_proj_bias", (*ffn, "wi_1_bias"), InterleavedBias(1)),
            TensorMap(experts + "down_proj", (*ffn, "wo"), SAME),
            TensorMap(experts + "down_proj_bias", (*ffn, "wo_bias"), SAME),
        ]
    maps.append(TensorMap("model.norm.weight", ("final_norm", "scale"), SAME))
    if not m.tie_embeddings:
        maps.append(TensorMap("lm_head.weight", ("lm_head",), Linear(1)))
    return maps


def is_gpt_oss(m: ModelOptions) -> bool:
    """Whether jaxmoe model `m` is written as GPT-OSS: only GPT-OSS has attention sinks."""
    return m.attention_sinks


def _refuse(reason: str):
    raise CheckpointError(f"not expressible as a Hugging Face GPT-OSS model: {reason}")


def gpt_oss_export(m: ModelOptions, max_positions: int) -> dict:
    """config.json of jaxmoe model `m` as GPT-OSS; refuses what GPT-OSS does not compute."""
    moe = m.moe
    wanted = {
        "arch": "decoder",
        "qkv_bias": True,
        "out_bias": True,
        "activation": "swiglu_clamped",
        "qk_norm": "none",
        "ffn_gated": True,
    }
    for key, value in wanted.items():
        if getattr(m, key) != value:
            _refuse(f"model.{key}={getattr(m, key)!r} (GPT-OSS has {value!r})")
    moe_wanted = {
        "router_bias": True,
        "expert_bias": True,
        "router_scoring": "softmax",
        "selection_bias": False,
        "num_shared_experts": 0,
        "capacity_factor": 0.0,
        "every": 1,
        "first_dense_layers": 0,
        "dense_layers": "",
    }
    if not moe.num_experts:
        _refuse("model.moe.num_experts=0 (GPT-OSS is MoE in every layer)")
    keys = as_dict(moe)  # the gate's and router's keys among model.moe's, as users name them
    for key, value in moe_wanted.items():
        if keys[key] != value:
            _refuse(f"model.moe.{key}={keys[key]!r} (GPT-OSS has {value!r})")
    gate = moe.eval_gate
    if gate.gating not in ("top1", "top2", "topk"):
        _refuse(f"model.moe.gating={gate.gating!r}: GPT-OSS routes to the top-k experts")
    k = {"top1": 1, "top2": 2}.get(gate.gating, gate.top_k)
    if (k > 1 and not gate.renormalize) or (k == 1 and gate.single_weight != "one"):
        _refuse("top-k weights not renormalised: GPT-OSS softmaxes the chosen logits")
    kinds = parse_layer_types(m.layer_types, m.num_layers, m.sliding_window)
    rope = {"rope_type": m.rope_type, "rope_theta": m.rope_theta}
    if m.rope_type == "yarn":
        rope |= {
            "factor": m.rope_factor,
            "beta_fast": m.rope_beta_fast,
            "beta_slow": m.rope_beta_slow,
            "truncate": m.rope_truncate,
            "original_max_position_embeddings": m.rope_original_max_len,
        }
        if m.rope_attention_factor:
            rope["attention_factor"] = m.rope_attention_factor
    elif m.rope_type != "default":
        _refuse(f"model.rope_type={m.rope_type!r} (GPT-OSS: default or yarn)")
    windowed = m.sliding_window > 0 and SLIDING in kinds
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": moe.ffn_dim,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": True,
        "attention_dropout": 0.0,
        # Always listed: without layer_types transformers alternates sliding and full.
        "sliding_window": m.sliding_window if windowed else None,
        "layer_types": [_HF_KIND[kind] for kind in kinds],
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": k,
        "swiglu_alpha": m.swiglu_alpha,
        "swiglu_limit": m.swiglu_limit,
        "router_aux_loss_coef": moe.balance_loss_weight,
        "output_router_logits": False,
    }
