"""jaxmoe MoE model config -> Qwen3-MoE, Qwen2-MoE or OLMoE config.json keys (`export hf`).

Which family a model is written as follows from what only that family computes:
`model.qk_norm=projection` is OLMoE, `model.qk_norm=head` is Qwen3-MoE, a shared expert is
Qwen2-MoE; an MoE model with none of them stays Mixtral (export_config.py). The routing
must be what these families do: softmax over all experts, the top k kept, renormalised
(norm_topk_prob) or not; anything else is refused with the field that says so.
The reverse direction is names_moe.py.
"""

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.models.layer_kinds import is_moe_layer
from jaxmoe.models.moe.router import RouterOptions
from jaxmoe.models.options import ModelOptions, MoEOptions


def _refuse(reason: str):
    raise CheckpointError(f"not expressible as a Hugging Face model: {reason}")


def refuse_unexported_routing(moe: MoEOptions) -> None:
    """Router options no exported family computes (DeepSeek-style scoring and biases)."""
    plain = RouterOptions()
    changed = [
        (key, getattr(moe.router, key))
        for key in ("router_scoring", "selection_bias", "routed_scaling_factor", "n_group")
        if getattr(moe.router, key) != getattr(plain, key)
    ]
    if moe.bias_update_rate:
        changed.append(("bias_update_rate", moe.bias_update_rate))
    for key, value in changed:
        _refuse(f"model.moe.{key}={value!r} (the exported MoE families route without it)")


def moe_family(m: ModelOptions) -> str | None:
    """The HF model_type an MoE model `m` is written as; None: Mixtral (or jaxmoe_moe)."""
    if m.qk_norm == "projection":
        return "olmoe"
    if m.qk_norm == "head":
        return "qwen3_moe"
    if m.moe.num_shared_experts:
        return "qwen2_moe"
    return None


def _norm_topk_prob(moe: MoEOptions, family: str) -> tuple[int, bool]:
    """(k, norm_topk_prob) of the gate jaxmoe evaluates with."""
    gate = moe.eval_gate
    if gate.gating not in ("top1", "top2", "topk"):
        _refuse(
            f"model.moe.gating={gate.gating!r}: {family} routes each token to its top-k experts"
        )
    k = {"top1": 1, "top2": 2}.get(gate.gating, gate.top_k)
    # One expert: renormalised its weight is p / p = 1, raw it is p.
    return k, (gate.single_weight == "one") if k == 1 else gate.renormalize


def _mlp_only_layers(m: ModelOptions) -> list[int]:
    """The layers `every` does not already make dense, which jaxmoe makes dense anyway
    (dense_layers, first_dense_layers)."""
    every = m.moe.every
    return [i for i in range(m.num_layers) if (i + 1) % every == 0 and not is_moe_layer(m, i)]


def family_fields(m: ModelOptions, family: str) -> dict:
    """config.json keys (over the Llama ones) of MoE model `m` written as `family`."""
    moe = m.moe
    if moe.capacity_factor > 0:
        _refuse(f"model.moe.capacity_factor={moe.capacity_factor}: {family} drops no tokens")
    shared = moe.num_shared_experts
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
        "decoder_sparse_step": moe.every,
        "mlp_only_layers": _mlp_only_layers(m),
        "use_sliding_window": False,
        "sliding_window": None,
    }
    if family == "qwen2_moe":
        if not moe.shared_expert_gate:
            _refuse("model.moe.shared_expert_gate=False: Qwen2-MoE gates its shared expert")
        width = shared * (moe.shared_ffn_dim or moe.ffn_dim)
        fields |= {
            "shared_expert_intermediate_size": width,
            "qkv_bias": m.qkv_bias,
            "max_window_layers": m.num_layers,
        }
    return fields
