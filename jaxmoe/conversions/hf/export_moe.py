"""jaxmoe MoE model config -> Qwen3-MoE, Qwen2-MoE or OLMoE config.json keys (`export hf`).

Which family a model is written as follows from what only that family computes:
`model.qk_norm=projection` is OLMoE, `model.qk_norm=head` is Qwen3-MoE, a shared expert is
Qwen2-MoE; an MoE model with none of them stays Mixtral (export_config.py). The routing
must be what these families do: softmax over all experts, the top k kept, renormalised
(norm_topk_prob) or not; anything else is refused with the field that says so.
The reverse direction is names_moe.py.
"""

from ml_collections import ConfigDict

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.models.ffn import is_moe_layer


def _refuse(reason: str):
    raise CheckpointError(f"not expressible as a Hugging Face model: {reason}")


def refuse_unexported_routing(moe: ConfigDict) -> None:
    """Router options no exported family computes (DeepSeek-style scoring and biases)."""
    checks = (
        ("router_scoring", "softmax"),
        ("selection_bias", False),
        ("routed_scaling_factor", 1.0),
        ("n_group", 1),
        ("bias_update_rate", 0.0),
    )
    for key, default in checks:
        value = moe.get(key, default)
        if value != default:
            _refuse(f"model.moe.{key}={value!r} (the exported MoE families route without it)")


def moe_family(m: ConfigDict) -> str | None:
    """The HF model_type an MoE model `m` is written as; None: Mixtral (or jaxmoe_moe)."""
    qk_norm = m.get("qk_norm", "none")
    if qk_norm == "projection":
        return "olmoe"
    if qk_norm == "head":
        return "qwen3_moe"
    if m.moe.get("num_shared_experts", 0):
        return "qwen2_moe"
    return None


def _norm_topk_prob(moe: ConfigDict, family: str) -> tuple[int, bool]:
    """(k, norm_topk_prob) of the gate jaxmoe evaluates with."""
    gating = moe.eval_gating or moe.gating
    if gating not in ("top1", "top2", "topk"):
        _refuse(f"model.moe.gating={gating!r}: {family} routes each token to its top-k experts")
    k = {"top1": 1, "top2": 2}.get(gating, int(moe.top_k))
    if k > moe.num_experts:
        _refuse(f"model.moe.top_k={k} exceeds model.moe.num_experts={moe.num_experts}")
    # One expert: renormalised its weight is p / p = 1, raw it is p.
    return k, (moe.single_weight == "one") if k == 1 else bool(moe.renormalize)


def _mlp_only_layers(m: ConfigDict) -> list[int]:
    """The layers `every` does not already make dense, which jaxmoe makes dense anyway
    (dense_layers, first_dense_layers)."""
    every = int(m.moe.every)
    return [i for i in range(m.num_layers) if (i + 1) % every == 0 and not is_moe_layer(m, i)]


def family_fields(m: ConfigDict, family: str) -> dict:
    """config.json keys (over the Llama ones) of MoE model `m` written as `family`."""
    moe = m.moe
    if moe.capacity_factor > 0:
        _refuse(f"model.moe.capacity_factor={moe.capacity_factor}: {family} drops no tokens")
    shared = int(moe.get("num_shared_experts", 0))
    if family != "qwen2_moe" and shared:
        _refuse(f"model.moe.num_shared_experts={shared} with model.qk_norm: {family} has none")
    if family != "qwen2_moe" and m.qkv_bias:
        _refuse(f"model.qkv_bias=True: {family} has no attention biases")
    k, norm = _norm_topk_prob(moe, family)
    fields = {
        "architectures": [
            {"olmoe": "OlmoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}.get(
                family, "Qwen2MoeForCausalLM"
            )
        ],
        "model_type": family,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": k,
        "norm_topk_prob": norm,
        "router_aux_loss_coef": moe.balance_loss_weight,
        "output_router_logits": False,
    }
    if family == "olmoe":
        if any(not is_moe_layer(m, i) for i in range(m.num_layers)):
            _refuse("a dense FFN layer (model.moe.every/dense_layers): OLMoE is MoE in every layer")
        if m.num_heads * m.head_dim != m.d_model:
            _refuse(
                f"model.num_heads x head_dim = {m.num_heads * m.head_dim} != d_model="
                f"{m.d_model}: OLMoE's query norm spans hidden_size"
            )
        return fields | {"intermediate_size": moe.ffn_dim, "clip_qkv": None}
    fields |= {
        "moe_intermediate_size": moe.ffn_dim,
        "decoder_sparse_step": int(moe.every),
        "mlp_only_layers": _mlp_only_layers(m),
        "use_sliding_window": False,
        "sliding_window": None,
    }
    if family == "qwen2_moe":
        if not moe.get("shared_expert_gate", False):
            _refuse("model.moe.shared_expert_gate=False: Qwen2-MoE gates its shared expert")
        width = shared * (int(moe.get("shared_ffn_dim", 0)) or int(moe.ffn_dim))
        fields |= {
            "shared_expert_intermediate_size": width,
            "qkv_bias": bool(m.qkv_bias),
            "max_window_layers": m.num_layers,
        }
    return fields
