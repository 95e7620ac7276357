"""DeepSeek-V2 / V3 config.json and tensor names <-> jaxmoe (`convert hf`, `export hf`).

Attention is multi-head latent attention (model.attention=mla, models/mla.py); the HF
tensors map one to one onto jaxmoe's, so both directions are transposes and reshapes:
q_proj or q_a_proj / q_a_layernorm / q_b_proj -> query or q_down / q_norm / q_up,
kv_a_proj_with_mqa [r + dr, D] -> kv_down, kv_a_layernorm -> kv_norm,
kv_b_proj [H (dn + dv), r] -> kv_up [r, H, dn + dv], o_proj -> out. Both write their
rotary dims interleaved (V3's rope_interleave=true; V2 rotates complex pairs), which is
mla.py's layout, so nothing is permuted.

The FFN is dense in layers 0..first_k_dense_replace-1 and an MoE after that: routed experts
`mlp.experts.{e}.{gate,up,down}_proj`, the always-on `mlp.shared_experts` (one FFN of
n_shared_experts x moe_intermediate_size) and the router `mlp.gate`. V3 scores experts by
sigmoid, chooses with e_score_correction_bias (model.moe.selection_bias) inside the
topk_group best of n_group groups, renormalises with norm_topk_prob and scales by
routed_scaling_factor; V2 takes the softmax top-k (transformers ignores its
norm_topk_prob) times routed_scaling_factor.

V3's multi-token-prediction layers (`num_nextn_predict_layers` = D) are
`model.layers.{N + k}` after the N main layers: enorm, hnorm, eh_proj [D, 2D] (input
[embedding; hidden]), shared_head.norm and a decoder layer's tensors, all of jaxmoe's
`mtp/<k>` (models/mtp.py, model.mtp_depth = D), plus `embed_tokens` and
`shared_head.head`, copies of the main embedding and output layer: read only to check that
they are copies (jaxmoe shares one of each), written back as copies on export. A config
announcing them without the tensors (what transformers saves) converts the main model with
a warning; MTP tensors the config does not announce are refused.
"""

import re
import sys

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.conversions.hf.hf_config import (
    ModelKeys,
    check_layer_count,
    config_number,
    config_size,
    model_keys,
    model_options,
    read_decoder_basics,
)
from jaxmoe.conversions.hf.names import (
    QWEN_EXPERT_NAMES,
    SAME,
    FusedGateUp,
    ImportPlan,
    Linear,
    StackedDown,
    TensorMap,
    gated_ffn_maps,
)
from jaxmoe.models.layer_kinds import is_moe_layer
from jaxmoe.models.options import ModelOptions

DEEPSEEK_FAMILIES = ("deepseek_v2", "deepseek_v3")
_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")


def _rope_params(hf: dict) -> dict:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"config.json: rope_parameters={params!r} is not an object")
    return params


def _read_rope(hf: dict, m: ModelKeys) -> None:
    """Plain or YaRN rotary of the rope dims (transformers 5.x `rope_parameters` or 4.x
    `rope_scaling` + `rope_theta`)."""
    params = _rope_params(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise CheckpointError(
            f"config.json: rope_type {rope_type!r} is not supported for DeepSeek (default | yarn)"
        )
    m["rope_theta"] = config_number(params if "rope_theta" in params else hf, "rope_theta", 10000.0)
    m["rope_type"] = rope_type
    if rope_type == "default":
        return
    m["rope_original_max_len"] = config_size(params, "original_max_position_embeddings")
    if params.get("factor") is None:  # transformers' rule: the context's stretch
        m["rope_factor"] = m["max_len"] / m["rope_original_max_len"]
    else:
        m["rope_factor"] = config_number(params, "factor")
    defaults = {"beta_fast": 32.0, "beta_slow": 1.0}
    for key in _YARN_KEYS:
        value = params.get(key)
        value = defaults.get(key, 0.0) if not value else config_number(params, key)
        m[f"rope_{key}"] = value
    m["rope_truncate"] = bool(params.get("truncate", True))


def _mtp_layers(hf: dict, present: set[str], num_layers: int) -> int:
    """The multi-token-prediction depth the checkpoint holds (0 when only announced, with a
    warning); layers past the main ones that the config does not announce are refused."""
    nextn = int(hf.get("num_nextn_predict_layers") or 0)
    extra = sorted(
        {
            int(x.group(1))
            for n in present
            if (x := re.match(r"model\.layers\.(\d+)\.", n)) and int(x.group(1)) >= num_layers
        }
    )
    if not extra:
        if nextn:
            print(
                f"convert hf: num_nextn_predict_layers={nextn} announced but no such tensors "
                "in the checkpoint: converting the main model only",
                file=sys.stderr,
            )
        return 0
    expected = list(range(num_layers, num_layers + nextn))
    if extra != expected:
        raise CheckpointError(
            f"config.json: num_nextn_predict_layers={nextn} after num_hidden_layers="
            f"{num_layers}, but the checkpoint holds layer(s) model.layers.{extra[0]}"
            + (f"..{extra[-1]}" if len(extra) > 1 else "")
            + " (multi-token-prediction layers must be the ones announced)"
        )
    return nextn


def _refuse_unsupported(hf: dict, family: str) -> None:
    if hf.get("attention_bias"):
        raise CheckpointError("config.json: attention_bias=true: jaxmoe's MLA has no biases")
    if family == "deepseek_v3" and hf.get("rope_interleave") is False:
        raise CheckpointError(
            "config.json: rope_interleave=false: jaxmoe's MLA rotates interleaved pairs only"
        )
    if (hf.get("moe_layer_freq") or 1) != 1:
        raise CheckpointError(
            f"config.json: moe_layer_freq={hf['moe_layer_freq']!r}: jaxmoe reads DeepSeek "
            "models with an MoE FFN in every layer after first_k_dense_replace"
        )
    method = hf.get("topk_method") or "greedy"
    if family == "deepseek_v2" and method != "greedy":
        raise CheckpointError(
            f"config.json: topk_method={method!r}: jaxmoe's group-limited routing ranks "
            "groups by their top-2 sum (DeepSeek-V3), not V2's max; greedy is supported"
        )


def read_deepseek(hf: dict, present: set[str], m: ModelKeys) -> None:
    """Sets model keys `m` from a DeepSeek-V2/V3 config.json `hf` (tensor names `present`)."""
    family = hf["model_type"]
    _refuse_unsupported(hf, family)
    layers = config_size(hf, "num_hidden_layers")
    m["mtp_depth"] = _mtp_layers(hf, present, layers)
    # The Llama-like sizes; rotary is read below (YaRN is MLA's, not read_rope's).
    basics = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
    basics["head_dim"] = None
    mtp = tuple(f"model.layers.{layers + k}." for k in range(m["mtp_depth"]))
    read_decoder_basics(basics, {n for n in present if not n.startswith(mtp)}, m)
    m["attention"] = "mla"
    m["num_kv_heads"] = m["num_heads"]  # every head has its own key and value (rebuilt)
    m["q_lora_rank"] = config_size(hf, "q_lora_rank", 0) if hf.get("q_lora_rank") else 0
    m["kv_lora_rank"] = config_size(hf, "kv_lora_rank")
    m["qk_nope_head_dim"] = config_size(hf, "qk_nope_head_dim")
    m["qk_rope_head_dim"] = config_size(hf, "qk_rope_head_dim")
    m["v_head_dim"] = config_size(hf, "v_head_dim")
    m["head_dim"] = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
    m["qkv_bias"], m["qk_norm"] = False, "none"
    _read_rope(hf, m)
    _read_moe(hf, m, family)


def _read_moe(hf: dict, m: ModelKeys, family: str) -> None:
    moe = m["moe"]
    moe["num_experts"] = config_size(hf, "n_routed_experts")
    k = config_size(hf, "num_experts_per_tok")
    if k > moe["num_experts"]:
        raise CheckpointError(
            f"config.json: num_experts_per_tok={k} exceeds n_routed_experts={moe['num_experts']}"
        )
    moe["ffn_dim"] = config_size(hf, "moe_intermediate_size")
    moe["every"], moe["dense_layers"] = 1, ""
    moe["first_dense_layers"] = int(hf.get("first_k_dense_replace") or 0)
    moe["gating"] = {1: "top1", 2: "top2"}.get(k, "topk")
    moe["top_k"], moe["eval_gating"] = k, ""
    moe["routed_scaling_factor"] = config_number(hf, "routed_scaling_factor", 1.0)
    moe["capacity_factor"], moe["jitter"], moe["z_loss_weight"] = 0.0, 0.0, 0.0
    moe["balance_loss_weight"] = config_number(hf, "aux_loss_alpha", 0.0)
    shared = int(hf.get("n_shared_experts") or 0)
    moe["num_shared_experts"] = shared
    moe["shared_ffn_dim"] = moe["ffn_dim"] if shared else 0
    moe["shared_expert_gate"] = False
    if family == "deepseek_v3":
        moe["router_scoring"], moe["selection_bias"] = "sigmoid", True
        moe["renormalize"] = bool(hf.get("norm_topk_prob", True))
        moe["n_group"] = config_size(hf, "n_group", 1)
        moe["topk_group"] = config_size(hf, "topk_group", 1)
        moe["balance_loss_weight"] = 0.0  # auxiliary-loss-free (selection bias)
    else:  # transformers' V2 router: the softmax top-k, never renormalised
        moe["router_scoring"], moe["selection_bias"], moe["renormalize"] = "softmax", False, False
        moe["single_weight"] = "prob"
        moe["n_group"], moe["topk_group"] = 1, 1


def _expert_style(present: set[str], m: ModelOptions) -> str:
    """`fused` (transformers 5.x in-memory names) or `per_expert`, the expert count checked."""
    if any(n.endswith(".experts.gate_up_proj") for n in present):
        return "fused"
    first = next((i for i in range(m.num_layers) if is_moe_layer(m, i)), None)
    if first is not None:
        pattern = rf"model\.layers\.{first}\.mlp\.experts\.(\d+)\.gate_proj\."
        check_layer_count(present, pattern, "n_routed_experts", m.moe.num_experts)
    return "per_expert"


def _mla_attention_maps(m: ModelOptions, hf: str, path: tuple[str, ...]) -> list[TensorMap]:
    if m.q_lora_rank:
        maps = [
            TensorMap(hf + "q_a_proj.weight", (*path, "q_down"), Linear(1)),
            TensorMap(hf + "q_a_layernorm.weight", (*path, "q_norm", "scale"), SAME),
            TensorMap(hf + "q_b_proj.weight", (*path, "q_up"), Linear(1)),
        ]
    else:
        maps = [TensorMap(hf + "q_proj.weight", (*path, "query"), Linear(1))]
    return [
        *maps,
        TensorMap(hf + "kv_a_proj_with_mqa.weight", (*path, "kv_down"), Linear(1)),
        TensorMap(hf + "kv_a_layernorm.weight", (*path, "kv_norm", "scale"), SAME),
        TensorMap(hf + "kv_b_proj.weight", (*path, "kv_up"), Linear(1)),
        TensorMap(hf + "o_proj.weight", (*path, "out"), Linear(2)),
    ]


def _moe_maps(m: ModelOptions, hf: str, path: tuple[str, ...], style: str) -> list[TensorMap]:
    maps = [TensorMap(hf + "gate.weight", (*path, "router"), Linear(1))]
    if m.moe.router.selection_bias:
        maps.append(TensorMap(hf + "gate.e_score_correction_bias", (*path, "selection_bias"), SAME))
    if style == "fused":
        fused = hf + "experts.gate_up_proj"
        maps += [
            TensorMap(fused, (*path, "wi_0"), FusedGateUp(0)),
            TensorMap(fused, (*path, "wi_1"), FusedGateUp(1)),
            TensorMap(hf + "experts.down_proj", (*path, "wo"), StackedDown()),
        ]
    else:
        for e in range(m.moe.num_experts):
            for name, leaf in zip(QWEN_EXPERT_NAMES, ("wi_0", "wi_1", "wo"), strict=True):
                weight = f"{hf}experts.{e}.{name}.weight"
                maps.append(TensorMap(weight, (*path, leaf), Linear(1), expert=e))
    if m.moe.num_shared_experts:
        shared = tuple(f"{hf}shared_experts.{p}.weight" for p in QWEN_EXPERT_NAMES)
        maps += gated_ffn_maps(shared, (*path, "shared"))
    return maps


def _layer_maps(m: ModelOptions, hf: str, path: tuple[str, ...], layer: int, style: str):
    """One decoder layer (HF prefix `hf`, jaxmoe `path`), dense or MoE as `layer` is."""
    maps = [TensorMap(hf + "input_layernorm.weight", (*path, "attn_norm", "scale"), SAME)]
    maps += _mla_attention_maps(m, hf + "self_attn.", (*path, "attn"))
    maps.append(
        TensorMap(hf + "post_attention_layernorm.weight", (*path, "ffn_norm", "scale"), SAME)
    )
    if is_moe_layer(m, layer):
        return maps + _moe_maps(m, hf + "mlp.", (*path, "ffn"), style)
    names = tuple(f"{hf}mlp.{p}.weight" for p in QWEN_EXPERT_NAMES)
    return maps + gated_ffn_maps(names, (*path, "ffn"))


def _mtp_maps(m: ModelOptions, style: str) -> list[TensorMap]:
    """The MTP modules' own tensors (models/mtp.py), as `model.layers.{N + k}.*`."""
    maps = []
    for k in range(m.mtp_depth):
        layer = m.num_layers + k
        hf, path = f"model.layers.{layer}.", ("mtp", str(k))
        maps += [
            TensorMap(hf + "enorm.weight", (*path, "embed_norm", "scale"), SAME),
            TensorMap(hf + "hnorm.weight", (*path, "hidden_norm", "scale"), SAME),
            TensorMap(hf + "eh_proj.weight", (*path, "proj"), Linear(1)),
            TensorMap(hf + "shared_head.norm.weight", (*path, "head_norm", "scale"), SAME),
        ]
        maps += _layer_maps(m, hf, (*path, "block"), layer, style)
    return maps


def mtp_copies(m: ModelOptions) -> dict[str, tuple]:
    """{HF name of an MTP layer's copy of a shared tensor: (the main tensor's HF name, its
    jaxmoe path, layout)}: `embed_tokens` and `shared_head.head` of every MTP layer."""
    head = ("lm_head.weight", ("lm_head",), Linear(1))
    if m.tie_embeddings:
        head = ("model.embed_tokens.weight", ("embed", "embedding"), SAME)
    copies = {}
    for k in range(m.mtp_depth):
        hf = f"model.layers.{m.num_layers + k}."
        copies[hf + "embed_tokens.weight"] = (
            "model.embed_tokens.weight",
            ("embed", "embedding"),
            SAME,
        )
        copies[hf + "shared_head.head.weight"] = head
    return copies


def deepseek_maps(m: ModelOptions, style: str = "per_expert") -> list[TensorMap]:
    """Every tensor of a DeepSeek-V2/V3 causal LM with jaxmoe model config `m`, the MTP
    modules' own included (their copies of shared tensors: `mtp_copies`)."""
    maps = [TensorMap("model.embed_tokens.weight", ("embed", "embedding"), SAME)]
    for i in range(m.num_layers):
        maps += _layer_maps(m, f"model.layers.{i}.", ("layers", str(i)), i, style)
    maps.append(TensorMap("model.norm.weight", ("final_norm", "scale"), SAME))
    if not m.tie_embeddings:
        maps.append(TensorMap("lm_head.weight", ("lm_head",), Linear(1)))
    return maps + _mtp_maps(m, style)


def deepseek_export_maps(m: ModelOptions) -> list[TensorMap]:
    """deepseek_maps plus the MTP layers' copies of the embedding and output layer."""
    copies = [TensorMap(name, path, layout) for name, (_, path, layout) in mtp_copies(m).items()]
    return deepseek_maps(m) + copies


def deepseek_plan(hf: dict, present: set[str]) -> tuple[ModelOptions, ImportPlan]:
    """names.import_plan for DeepSeek-V2/V3."""
    m = model_keys()
    read_deepseek(hf, present, m)
    model = model_options(m)
    style = _expert_style(present, model)
    copies = {name: source for name, (source, _, _) in mtp_copies(model).items()}
    return model, ImportPlan(deepseek_maps(model, style), copies)


# ----------------------------------------------------------------------------- export


def _refuse(reason: str):
    raise CheckpointError(f"not expressible as a Hugging Face DeepSeek model: {reason}")


def _export_rope(m: ModelOptions) -> dict:
    rope = {"rope_type": m.rope_type, "rope_theta": m.rope_theta}
    if m.rope_type == "default":
        return rope
    if m.rope_type != "yarn":
        _refuse(f"model.rope_type={m.rope_type!r} (DeepSeek configs write default or yarn)")
    rope |= {
        "factor": m.rope_factor,
        "original_max_position_embeddings": m.rope_original_max_len,
        "beta_fast": m.rope_beta_fast,
        "beta_slow": m.rope_beta_slow,
        "truncate": m.rope_truncate,
    }
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(m, f"rope_{key}"):
            rope[key] = getattr(m, f"rope_{key}")
    return rope


def _export_moe(m: ModelOptions) -> tuple[str, dict]:
    """(model_type, its MoE config.json keys): V3 for sigmoid scores with a selection bias,
    V2 for the softmax top-k; a dense MLA model is V3 with every layer dense."""
    moe = m.moe
    if not moe.num_experts:
        return "deepseek_v3", {
            "first_k_dense_replace": m.num_layers,
            "n_routed_experts": 1,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": m.ffn_dim,
            "n_shared_experts": 1,
        }
    gate, router = moe.eval_gate, moe.router
    if gate.gating not in ("top1", "top2", "topk"):
        _refuse(
            f"model.moe.gating={gate.gating!r}: DeepSeek routes each token to its top-k experts"
        )
    k = {"top1": 1, "top2": 2}.get(gate.gating, gate.top_k)
    regular = all(is_moe_layer(m, i) == (i >= moe.first_dense_layers) for i in range(m.num_layers))
    checks = (
        (not regular, "MoE layers other than all after model.moe.first_dense_layers"),
        (moe.capacity_factor > 0, f"model.moe.capacity_factor={moe.capacity_factor} (dropping)"),
        (moe.router_bias, "model.moe.router_bias=True"),
        (moe.shared_expert_gate, "model.moe.shared_expert_gate=True"),
        (not moe.num_shared_experts, "no shared expert (model.moe.num_shared_experts=0)"),
        (
            moe.shared_ffn_dim not in (0, moe.ffn_dim),
            f"model.moe.shared_ffn_dim={moe.shared_ffn_dim} != model.moe.ffn_dim",
        ),
    )
    for bad, reason in checks:
        if bad:
            _refuse(reason)
    fields = {
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": k,
        "moe_intermediate_size": moe.ffn_dim,
        "n_shared_experts": moe.num_shared_experts,
        "first_k_dense_replace": moe.first_dense_layers,
        "routed_scaling_factor": router.routed_scaling_factor,
    }
    if router.router_scoring == "sigmoid":
        if not router.selection_bias:
            _refuse("router_scoring=sigmoid without model.moe.selection_bias (V3 has one)")
        return "deepseek_v3", fields | {
            "n_group": router.n_group,
            "topk_group": router.topk_group,
            "norm_topk_prob": gate.renormalize if k > 1 else True,
            "topk_method": "noaux_tc",
        }
    if router.selection_bias or router.n_group != 1 or (gate.renormalize and k > 1):
        _refuse("softmax routing with a selection bias, groups or renormalisation")
    if k == 1 and gate.single_weight == "one":
        _refuse("model.moe.single_weight='one' (V2 weighs one expert by its probability)")
    return "deepseek_v2", fields | {"topk_method": "greedy", "norm_topk_prob": False}


def deepseek_export(m: ModelOptions, max_positions: int) -> dict:
    """config.json of MLA model `m` as DeepSeek-V3 (or V2: softmax routing)."""
    if m.activation != "silu" or not m.ffn_gated:
        _refuse(f"model.activation={m.activation!r} (DeepSeek's FFNs are SwiGLU)")
    family, moe_fields = _export_moe(m)
    hf = {
        "architectures": [
            "DeepseekV3ForCausalLM" if family == "deepseek_v3" else "DeepseekV2ForCausalLM"
        ],
        "model_type": family,
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn_dim,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_heads,
        "q_lora_rank": m.q_lora_rank or None,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": _export_rope(m),
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_nextn_predict_layers": m.mtp_depth,
        **moe_fields,
    }
    if family == "deepseek_v3":
        hf["rope_interleave"] = True
    return hf
