"""Hugging Face <-> jaxmoe: the tensor name table (both directions) and HF config -> jaxmoe.

One table serves import and export. A `TensorMap` pairs one HF tensor with one jaxmoe
parameter (or one expert's slice of it) and a layout that converts between their shapes.
HF linear weights are [out, in]; jaxmoe kernels are [in..., out...] (query [D, H, dh],
out [H, dh, D], wi_0 [D, F], router [D, E], experts wi_0 [E, D, F]), so most maps are a
transpose plus a reshape. Rotary embeddings use the same rotate-half layout on both sides,
so query/key need no permutation. The other direction, jaxmoe config -> HF config.json,
is export_config.py.
"""

import math
import re
from dataclasses import dataclass, field

import numpy as np

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.conversions.hf.hf_config import (
    check_layer_count,
    config_number,
    config_size,
    model_keys,
    model_options,
    read_activation,
    read_decoder_basics,
)
from jaxmoe.conversions.hf.names_moe import MOE_FAMILIES, read_moe_family
from jaxmoe.conversions.hf.remote import MODEL_TYPE, import_gate
from jaxmoe.models.layer_kinds import is_moe_layer
from jaxmoe.models.options import ModelOptions

SUPPORTED_MODEL_TYPES = (
    *("llama", "mistral", "mixtral", "qwen2", *MOE_FAMILIES, "t5", "gpt_oss", "jaxmoe_moe"),
)
SUPPORTED_MODEL_TYPES += ("deepseek_v2", "deepseek_v3")  # names_deepseek.py
# Tensors HF itself skips when loading: derived buffers and an unused T5 table.
_IGNORED = (
    re.compile(r".*\.rotary_emb\.inv_freq"),
    re.compile(r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight"),
)


@dataclass(frozen=True)
class Same:
    """Identical layout on both sides (norm scales, embedding tables)."""

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape)

    def to_jaxmoe(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return hf

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        return x


@dataclass(frozen=True)
class Linear:
    """HF [out, in] <-> jaxmoe [*in_axes, *out_axes]: the first `in_axes` jaxmoe axes form
    HF's `in`. `scale` multiplies on import (T5's tied output layer scaled by d**-0.5)."""

    in_axes: int = 1
    scale: float = 1.0

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (math.prod(shape[self.in_axes :]), math.prod(shape[: self.in_axes]))

    def to_jaxmoe(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        x = hf.T.reshape(shape)
        return x * np.asarray(self.scale, x.dtype) if self.scale != 1.0 else x

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        hf = x.reshape(math.prod(x.shape[: self.in_axes]), -1).T
        return hf / np.asarray(self.scale, x.dtype) if self.scale != 1.0 else hf


@dataclass(frozen=True)
class FusedGateUp:
    """transformers 5.x in-memory experts `gate_up_proj` [E, 2F, D] (gate rows first) ->
    wi_0 (part 0) or wi_1 (part 1) [E, D, F]. Import only: export writes per-expert names."""

    part: int

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        experts, d, f = shape
        return (experts, 2 * f, d)

    def to_jaxmoe(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        f = shape[2]
        return hf[:, self.part * f : (self.part + 1) * f, :].transpose(0, 2, 1)

    to_hf = None


@dataclass(frozen=True)
class StackedDown:
    """transformers 5.x in-memory experts `down_proj` [E, D, F] -> wo [E, F, D]. Import only."""

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        experts, f, d = shape
        return (experts, d, f)

    def to_jaxmoe(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return hf.transpose(0, 2, 1)

    to_hf = None


@dataclass(frozen=True)
class Bias:
    """HF bias [N * d] <-> jaxmoe [N, d] (query/key/value biases per head)."""

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (math.prod(shape),)

    def to_jaxmoe(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return hf.reshape(shape)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(-1)


Layout = Same | Linear | Bias | FusedGateUp | StackedDown
SAME = Same()
BIAS = Bias()


@dataclass(frozen=True)
class TensorMap:
    """HF tensor `hf_name` <-> jaxmoe parameter `path` (slice `expert` of it when set)."""

    hf_name: str
    path: tuple[str, ...]
    layout: Layout
    expert: int | None = None

    def slot_shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape this map fills in a jaxmoe leaf of `leaf_shape` (one expert, or all)."""
        return tuple(leaf_shape[1:] if self.expert is not None else leaf_shape)

    def hf_shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        return self.layout.hf_shape(self.slot_shape(leaf_shape))


@dataclass
class ImportPlan:
    """What a conversion reads: the maps, tied copies that must equal their source, and
    names HF itself ignores."""

    maps: list[TensorMap]
    tied_copies: dict[str, str] = field(default_factory=dict)  # copy name -> source name

    @staticmethod
    def is_ignored(name: str) -> bool:
        return any(pattern.fullmatch(name) for pattern in _IGNORED)


# ----------------------------------------------------------------------------- tables


def attention_maps(
    hf_prefix: str, path: tuple[str, ...], name_format: str, qkv_bias: bool = False
) -> list[TensorMap]:
    """q/k/v [H*dh or K*dh, D] -> [D, heads, dh]; o [D, H*dh] -> [H, dh, D]; with `qkv_bias`
    also the q/k/v biases [H*dh or K*dh] -> [heads, dh] (a Linear with no input axes)."""
    pairs = (("q", "query", 1), ("k", "key", 1), ("v", "value", 1), ("o", "out", 2))
    maps = [
        TensorMap(hf_prefix + name_format.format(short), (*path, long), Linear(in_axes))
        for short, long, in_axes in pairs
    ]
    if qkv_bias:
        bias_format = name_format.replace(".weight", ".bias")
        maps += [
            TensorMap(hf_prefix + bias_format.format(short), (*path, f"{long}_bias"), BIAS)
            for short, long, _ in pairs[:3]
        ]
    return maps


def gated_ffn_maps(names: tuple[str, str, str], path: tuple[str, ...]) -> list[TensorMap]:
    """(gate, up, down) HF names -> wi_0 [D, F], wi_1 [D, F], wo [F, D]."""
    return [
        TensorMap(hf, (*path, leaf), Linear(1))
        for hf, leaf in zip(names, ("wi_0", "wi_1", "wo"), strict=True)
    ]


# Per-expert tensor names (gate, up, down) as save_pretrained writes them.
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")  # also Qwen2-MoE, Qwen3-MoE, OLMoE


def _moe_maps(
    m: ModelOptions,
    hf_prefix: str,
    path: tuple[str, ...],
    style: str,
    expert_names: tuple[str, str, str] = MIXTRAL_EXPERT_NAMES,
):
    """One MoE layer's router and experts. style: `per_expert` (one tensor per expert, the
    `expert_names` (gate, up, down); what save_pretrained writes) or `fused` (transformers
    5.x in-memory names). Shared experts (Qwen2-MoE) follow when model.moe has them."""
    maps = [TensorMap(hf_prefix + "gate.weight", (*path, "router"), Linear(1))]
    if style == "fused":
        fused = hf_prefix + "experts.gate_up_proj"
        maps += [
            TensorMap(fused, (*path, "wi_0"), FusedGateUp(0)),
            TensorMap(fused, (*path, "wi_1"), FusedGateUp(1)),
            TensorMap(hf_prefix + "experts.down_proj", (*path, "wo"), StackedDown()),
        ]
    else:
        for e in range(m.moe.num_experts):
            expert = f"{hf_prefix}experts.{e}."
            for hf, leaf in zip(expert_names, ("wi_0", "wi_1", "wo"), strict=True):
                maps.append(TensorMap(f"{expert}{hf}.weight", (*path, leaf), Linear(1), expert=e))
    if m.moe.num_shared_experts:
        shared = tuple(f"{hf_prefix}shared_expert.{p}.weight" for p in QWEN_EXPERT_NAMES)
        maps += gated_ffn_maps(shared, (*path, "shared"))
    if m.moe.shared_expert_gate:
        gate_path = (*path, "shared_gate", "kernel")  # [D, 1]; HF [1, D]
        maps.append(TensorMap(hf_prefix + "shared_expert_gate.weight", gate_path, Linear(1)))
    return maps


def _qk_norm_maps(m: ModelOptions, hf_prefix: str, path: tuple[str, ...]) -> list[TensorMap]:
    """Query/key RMSNorm scales: [dh] per head (Qwen3) or [H*dh] / [K*dh] (OLMoE); the same
    layout on both sides."""
    if m.qk_norm == "none":
        return []
    return [
        TensorMap(f"{hf_prefix}{name}.weight", (*path, name, "scale"), SAME)
        for name in ("q_norm", "k_norm")
    ]


def decoder_maps(
    m: ModelOptions,
    *,
    moe_prefix: str = "block_sparse_moe",
    moe_style: str = "per_expert",
    expert_names: tuple[str, str, str] = MIXTRAL_EXPERT_NAMES,
) -> list[TensorMap]:
    """Llama / Mistral / Mixtral names (Qwen2-MoE, Qwen3-MoE, OLMoE with `moe_prefix="mlp"`
    and `QWEN_EXPERT_NAMES`) for a jaxmoe DecoderLM with model config `m`."""
    maps = [TensorMap("model.embed_tokens.weight", ("embed", "embedding"), SAME)]
    for i in range(m.num_layers):
        hf, path = f"model.layers.{i}.", ("layers", str(i))
        maps.append(TensorMap(hf + "input_layernorm.weight", (*path, "attn_norm", "scale"), SAME))
        maps += attention_maps(hf + "self_attn.", (*path, "attn"), "{}_proj.weight", m.qkv_bias)
        maps += _qk_norm_maps(m, hf + "self_attn.", (*path, "attn"))
        maps.append(
            TensorMap(hf + "post_attention_layernorm.weight", (*path, "ffn_norm", "scale"), SAME)
        )
        if is_moe_layer(m, i):
            maps += _moe_maps(m, f"{hf}{moe_prefix}.", (*path, "ffn"), moe_style, expert_names)
        else:
            names = tuple(f"{hf}mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
            maps += gated_ffn_maps(names, (*path, "ffn"))
    maps.append(TensorMap("model.norm.weight", ("final_norm", "scale"), SAME))
    if not m.tie_embeddings:
        maps.append(TensorMap("lm_head.weight", ("lm_head",), Linear(1)))
    return maps


def t5_maps(m: ModelOptions, *, lm_head_name: str = "lm_head.weight", lm_head_scale: float = 1.0):
    """T5 (v1.1, gated FFN) names for a jaxmoe EncoderDecoderLM with model config `m`."""
    relpos = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    maps = [
        TensorMap("shared.weight", ("token_embed", "embedding"), SAME),
        TensorMap(f"encoder.{relpos}", ("encoder_relpos", "rel_embedding"), Linear(1)),
        TensorMap(f"decoder.{relpos}", ("decoder_relpos", "rel_embedding"), Linear(1)),
        TensorMap("encoder.final_layer_norm.weight", ("encoder_norm", "scale"), SAME),
        TensorMap("decoder.final_layer_norm.weight", ("decoder_norm", "scale"), SAME),
        TensorMap(lm_head_name, ("lm_head",), Linear(1, lm_head_scale)),
    ]
    sublayers = {
        "encoder": (("SelfAttention", "attn_norm", "attn"),),
        "decoder": (
            ("SelfAttention", "self_attn_norm", "self_attn"),
            ("EncDecAttention", "cross_attn_norm", "cross_attn"),
        ),
    }
    layer_counts = {"encoder": m.num_encoder_layers or m.num_layers, "decoder": m.num_layers}
    for stack, attentions in sublayers.items():
        for i in range(layer_counts[stack]):
            path = (f"{stack}_layers", str(i))
            for j, (hf_attn, norm, attn) in enumerate(attentions):
                hf = f"{stack}.block.{i}.layer.{j}."
                maps.append(TensorMap(hf + "layer_norm.weight", (*path, norm, "scale"), SAME))
                maps += attention_maps(f"{hf}{hf_attn}.", (*path, attn), "{}.weight")
            hf = f"{stack}.block.{i}.layer.{len(attentions)}."
            maps.append(TensorMap(hf + "layer_norm.weight", (*path, "ffn_norm", "scale"), SAME))
            names = tuple(f"{hf}DenseReluDense.{w}.weight" for w in ("wi_0", "wi_1", "wo"))
            maps += gated_ffn_maps(names, (*path, "ffn"))
    return maps


# ----------------------------------------------------------------------------- import


def _decoder_plan(hf: dict, present: set[str]) -> tuple[ModelOptions, ImportPlan]:
    if hf.get("mlp_bias"):
        raise CheckpointError("config.json: mlp_bias=true: jaxmoe FFN projections have no bias")
    if hf.get("attention_bias"):  # Llama's flag: a bias on o_proj too
        raise CheckpointError(
            "config.json: attention_bias=true: jaxmoe has q/k/v biases (Qwen2) but no "
            "output-projection bias"
        )
    m = model_keys()
    m["qkv_bias"] = hf["model_type"] == "qwen2"  # Qwen2: q/k/v biases always, none on o_proj
    read_decoder_basics(hf, present, m)
    moe_prefix, moe_style = "block_sparse_moe", "per_expert"
    if hf["model_type"] in ("mixtral", MODEL_TYPE):
        k = config_size(hf, "num_experts_per_tok")
        moe = m["moe"]
        moe["num_experts"] = config_size(hf, "num_local_experts")
        if not any(n.endswith(".experts.gate_up_proj") for n in present):  # one name each
            experts = r"model\.layers\.0\.\w+\.experts\.(\d+)\.w1\."
            check_layer_count(present, experts, "num_local_experts", moe["num_experts"])
        moe["every"] = 1
        moe["ffn_dim"] = m["ffn_dim"]
        moe["gating"] = {1: "top1", 2: "top2"}.get(k, "topk")
        moe["top_k"] = k
        moe["renormalize"] = True  # softmax over all experts, top-k, weights renormalised
        moe["single_weight"] = "one"  # k = 1: the renormalised weight of one expert is 1
        moe["eval_gating"] = ""
        moe["capacity_factor"] = 0.0  # Mixtral is dropless
        moe["jitter"] = config_number(hf, "router_jitter_noise", 0.0)
        moe["balance_loss_weight"] = config_number(hf, "router_aux_loss_coef", 0.0)
        moe["z_loss_weight"] = 0.0  # Mixtral trains without a router z-loss
        if hf["model_type"] == MODEL_TYPE:  # a jaxmoe export: its gate, from jaxmoe_gate
            import_gate(hf, moe)
        if not any(".block_sparse_moe." in n for n in present):
            moe_prefix = "mlp"  # transformers 5.x module names
        if any(n.endswith(".experts.gate_up_proj") for n in present):
            moe_style = "fused"
    else:
        m["moe"]["num_experts"] = 0
    model = model_options(m)
    return model, ImportPlan(decoder_maps(model, moe_prefix=moe_prefix, moe_style=moe_style))


def _t5_plan(hf: dict, present: set[str]) -> tuple[ModelOptions, ImportPlan]:
    ffn = hf.get("feed_forward_proj", "relu")
    if not ffn.startswith("gated-"):
        raise CheckpointError(
            f"config.json: feed_forward_proj={ffn!r} is the original T5's ungated FFN; "
            "jaxmoe implements T5 v1.1 (gated-gelu)"
        )
    act = ffn.removeprefix("gated-")
    m = model_keys()
    m["arch"] = "encoder_decoder"
    m["vocab_size"] = config_size(hf, "vocab_size")
    m["d_model"] = config_size(hf, "d_model")
    m["num_heads"] = m["num_kv_heads"] = config_size(hf, "num_heads")
    m["encoder_num_kv_heads"] = 0
    m["head_dim"] = config_size(hf, "d_kv")
    m["ffn_dim"] = config_size(hf, "d_ff")
    m["num_encoder_layers"] = config_size(hf, "num_layers")
    m["num_layers"] = config_size(hf, "num_decoder_layers", m["num_encoder_layers"])
    check_layer_count(present, r"encoder\.block\.(\d+)\.", "num_layers", m["num_encoder_layers"])
    check_layer_count(present, r"decoder\.block\.(\d+)\.", "num_decoder_layers", m["num_layers"])
    m["activation"] = read_activation("gelu_new" if act == "gelu" else act, "feed_forward_proj")
    m["norm_eps"] = config_number(hf, "layer_norm_epsilon", 1e-6)
    m["rope_theta"] = 0.0
    m["relpos_buckets"] = config_size(hf, "relative_attention_num_buckets", 32)
    m["relpos_max_distance"] = config_size(hf, "relative_attention_max_distance", 128)
    m["tie_embeddings"] = False  # jaxmoe's T5 always has its own output layer
    m["moe"]["num_experts"] = 0
    # transformers: v4 configs scale decoder outputs by d**-0.5 unless tie_word_embeddings is
    # false (T5 v1.1); v5 writes the flag itself. Folding it into lm_head keeps logits exact.
    if "scale_decoder_outputs" in hf:
        scaled = bool(hf["scale_decoder_outputs"])
    else:
        scaled = hf.get("tie_word_embeddings", True) is not False
    lm_head = "lm_head.weight" if "lm_head.weight" in present else "shared.weight"
    model = model_options(m)
    scale = model.d_model**-0.5 if scaled else 1.0
    maps = t5_maps(model, lm_head_name=lm_head, lm_head_scale=scale)
    copies = {
        name: "shared.weight"
        for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
        if name in present
    }
    return model, ImportPlan(maps, copies)


def import_plan(hf: dict, present: set[str]) -> tuple[ModelOptions, ImportPlan]:
    """The jaxmoe model section HF's config.json `hf` describes, and the tensor plan for the
    tensor names `present` in the checkpoint."""
    model_type = hf.get("model_type")
    if model_type in ("llama", "mistral", "mixtral", "qwen2", MODEL_TYPE):
        return _decoder_plan(hf, present)
    if model_type in MOE_FAMILIES:
        m = model_keys()
        style = read_moe_family(hf, present, m)
        model = model_options(m)
        maps = decoder_maps(
            model, moe_prefix="mlp", moe_style=style, expert_names=QWEN_EXPERT_NAMES
        )
        return model, ImportPlan(maps)
    if model_type == "t5":
        return _t5_plan(hf, present)
    supported = " | ".join(SUPPORTED_MODEL_TYPES)
    raise CheckpointError(f"config.json: model_type {model_type!r} is not supported ({supported})")
