"""jaxmoe model config -> Hugging Face config.json, with the tensor maps of names.py.

Only what transformers computes exactly is written: dense decoders as Llama (Qwen2 with q/k/v
biases), MoE decoders as Mixtral (other gates as `jaxmoe_moe`: remote.py) or, with q/k norms
or a shared expert, as Qwen3-MoE / OLMoE / Qwen2-MoE (export_moe.py), T5 v1.1; anything else
is refused with the reason (a CheckpointError).
"""

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.conversions.hf.export_moe import family_fields, moe_family, refuse_unexported_routing
from jaxmoe.conversions.hf.names import QWEN_EXPERT_NAMES, TensorMap, decoder_maps, t5_maps
from jaxmoe.conversions.hf.names_deepseek import deepseek_export, deepseek_export_maps
from jaxmoe.conversions.hf.names_gpt_oss import gpt_oss_export, gpt_oss_maps, is_gpt_oss
from jaxmoe.conversions.hf.remote import remote_fields, stock_top_k
from jaxmoe.models.layer_kinds import is_moe_layer
from jaxmoe.models.options import ModelOptions

# The gates modeling_jaxmoe_moe.py implements (its router's rules).
REMOTE_GATES = ("top1", "top2", "topk", "adaptive", "top_p")
_ACT_TO_HF = {"silu": "silu", "gelu": "gelu_pytorch_tanh", "relu": "relu"}


def _refuse(reason: str):
    raise CheckpointError(f"not expressible as a Hugging Face model: {reason}")


def _hf_activation(m: ModelOptions) -> str:
    if m.activation not in _ACT_TO_HF:
        _refuse(f"model.activation={m.activation!r}")
    return _ACT_TO_HF[m.activation]


def _mixtral_fields(m: ModelOptions) -> dict:
    """Mixtral's config keys; routing stock Mixtral cannot express goes to `jaxmoe_moe`
    (remote.py). Exported models route as jaxmoe evaluates: with `eval_gating`."""
    moe = m.moe
    dense = [i for i in range(m.num_layers) if not is_moe_layer(m, i)]
    if dense:
        _refuse(
            f"model.moe.every={moe.every} (dense layers {dense}): Mixtral has an MoE FFN in "
            "every layer (Qwen3-MoE / Qwen2-MoE place dense layers, with q/k norms or a "
            "shared expert)"
        )
    if moe.capacity_factor > 0:
        _refuse(f"model.moe.capacity_factor={moe.capacity_factor}: Mixtral drops no tokens")
    gate = moe.eval_gate
    fields = {
        "intermediate_size": moe.ffn_dim,
        "num_local_experts": moe.num_experts,
        "router_aux_loss_coef": moe.balance_loss_weight,
        "router_jitter_noise": moe.jitter,
        "output_router_logits": False,
        "sliding_window": None,
    }
    k = stock_top_k(gate)
    if k is None:
        if gate.gating not in REMOTE_GATES:  # a gate newer than modeling_jaxmoe_moe.py
            _refuse(
                f"model.moe.gating={gate.gating!r} (the shipped modeling file has no such gate)"
            )
        return fields | remote_fields(moe, gate)
    return fields | {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_experts_per_tok": k,
    }


def _decoder_export(m: ModelOptions, max_positions: int) -> dict:
    if m.moe.num_experts:
        refuse_unexported_routing(m.moe)
    if m.qk_norm != "none" and not m.moe.num_experts:
        _refuse(f"model.qk_norm={m.qk_norm!r} in a dense model (exported are the MoE families)")
    if not m.rope_theta:
        _refuse("model.rope_theta=0: Llama/Mixtral need rotary positions")
    rope = _rope_export(m)
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn_dim,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": _hf_activation(m),
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,  # transformers 4.x
        "rope_parameters": rope,  # transformers 5.x
        "rope_scaling": None if rope["rope_type"] == "default" else rope,  # transformers 4.x
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
    }
    family = moe_family(m) if m.moe.num_experts else None
    if family:
        hf.update(family_fields(m, family))
        del hf["mlp_bias"]  # not a key of these families: their FFNs have no bias
        if family == "qwen2_moe":
            del hf["attention_bias"]  # Qwen2-MoE says qkv_bias
    elif m.moe.num_experts:
        if m.qkv_bias:
            _refuse(
                "model.qkv_bias=True with MoE and no shared expert: Mixtral has no attention "
                "biases (Qwen2-MoE has, with a shared expert)"
            )
        hf.update(_mixtral_fields(m))
    elif m.qkv_bias:
        hf.update(
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=m.num_layers,
        )
        del hf["attention_bias"], hf["mlp_bias"]  # not Qwen2 keys: its q/k/v have biases
    return hf


def _rope_export(m: ModelOptions) -> dict:
    """transformers' rope_parameters for the model's rotary scaling."""
    rope = {"rope_type": m.rope_type, "rope_theta": m.rope_theta}
    if rope["rope_type"] in ("linear", "llama3"):
        rope["factor"] = m.rope_factor
    if rope["rope_type"] == "llama3":
        rope["low_freq_factor"] = m.rope_low_freq_factor
        rope["high_freq_factor"] = m.rope_high_freq_factor
        rope["original_max_position_embeddings"] = m.rope_original_max_len
    return rope


def _t5_export(m: ModelOptions) -> dict:
    if m.num_kv_heads != m.num_heads:
        _refuse(
            f"HF T5 attention is multi-head, but model.num_kv_heads={m.num_kv_heads} != "
            f"model.num_heads={m.num_heads} (GQA/MQA decoder)"
        )
    if m.encoder_num_kv_heads not in (0, m.num_heads):
        _refuse(f"model.encoder_num_kv_heads={m.encoder_num_kv_heads}: HF T5 is multi-head")
    if m.moe.num_experts:
        _refuse(f"model.moe.num_experts={m.moe.num_experts}: HF T5 has no MoE FFN")
    if m.activation not in ("gelu", "silu", "relu"):
        _refuse(f"model.activation={m.activation!r}")
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "vocab_size": m.vocab_size,
        "d_model": m.d_model,
        "d_kv": m.head_dim,
        "d_ff": m.ffn_dim,
        "num_layers": m.num_encoder_layers or m.num_layers,
        "num_decoder_layers": m.num_layers,
        "num_heads": m.num_heads,
        "relative_attention_num_buckets": m.relpos_buckets,
        "relative_attention_max_distance": m.relpos_max_distance,
        "layer_norm_epsilon": m.norm_eps,
        "feed_forward_proj": f"gated-{m.activation}",
        "dropout_rate": 0.0,
        "is_encoder_decoder": True,
        # Untied and unscaled (T5 v1.1): both spellings, for transformers 4.x and 5.x.
        "tie_word_embeddings": False,
        "scale_decoder_outputs": False,
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
        "eos_token_id": 1,
    }


def export_plan(m: ModelOptions, max_positions: int = 2048) -> tuple[dict, list[TensorMap]]:
    """(HF config.json dict, tensor maps) for jaxmoe model config `m`; a CheckpointError with
    the reason when HF cannot express the model."""
    if not m.ffn_gated:
        _refuse("model.ffn_gated=False (ungated FFN; the exported families are gated)")
    if m.attention == "mla":  # latent attention: only DeepSeek has it
        return deepseek_export(m, max_positions), deepseek_export_maps(m)
    if is_gpt_oss(m):  # attention sinks: only GPT-OSS has them
        return gpt_oss_export(m, max_positions), gpt_oss_maps(m)
    if m.moe.num_experts and m.moe.router_bias:
        _refuse("model.moe.router_bias=True (the exported MoE routers have no bias)")
    if m.arch == "encoder_decoder":
        if m.tie_embeddings:
            _refuse("model.tie_embeddings with arch=encoder_decoder (exported T5 is untied)")
        return _t5_export(m), t5_maps(m)
    hf = _decoder_export(m, max_positions)
    if hf["model_type"] in ("qwen3_moe", "qwen2_moe", "olmoe"):
        return hf, decoder_maps(m, moe_prefix="mlp", expert_names=QWEN_EXPERT_NAMES)
    return hf, decoder_maps(m)
