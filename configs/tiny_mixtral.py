"""Tiny Mixtral: the peer model of the throughput comparison (benchmarks/train_throughput.py).

vocab 8192, d_model 256, 4 layers, 8 query / 2 KV heads of 32, every layer an MoE of 8
SwiGLU experts of hidden 512, top-2 with the two weights renormalised (Mixtral), RMSNorm,
rotary positions, untied embeddings, sequence 256, batch 8, AdamW, float32: 17,443,072
parameters, the same as Hugging Face's MixtralForCausalLM at these sizes.

Throughput against Hugging Face transformers on the same model (all variants):
    python -m benchmarks train_throughput --peer hf
Train it (on the embedded corpus, whose tokenizer is smaller than the 8192-id vocabulary):
    jaxmoe train --config configs/tiny_mixtral.py --workdir runs/tiny_mixtral
Variants:  :top1 (one expert, weight 1 as Mixtral with num_experts_per_tok=1)
           :adaptive (two experts when p1 - p2 < 0.1, else one with weight 1)
           :dense (a SwiGLU FFN of 1024 in every layer: Llama at the same sizes)
"""

from ml_collections import ConfigDict

from jaxmoe.config.defaults import base_config

VARIANTS = ("top2", "top1", "adaptive", "dense")


def get_config(variant: str | None = None) -> ConfigDict:
    c = base_config()  # every key: `python -m jaxmoe.config` (docs/configs.md)
    m = c.model
    m.vocab_size = 8192
    m.num_layers = 4
    m.d_model = 256
    m.num_heads = 8
    m.num_kv_heads = 2
    m.head_dim = 32
    m.ffn_dim = 1024  # dense FFN width: the :dense variant only
    m.activation = "silu"  # SwiGLU experts
    m.rope_theta = 10000.0
    m.tie_embeddings = False
    m.dtype = "float32"
    m.remat = "none"  # 17M parameters at batch 8 x 256 fit easily: recompute costs time

    moe = m.moe
    moe.num_experts = 8
    moe.every = 1  # every layer is an MoE layer, as in Mixtral
    moe.ffn_dim = 512
    moe.gating = "top2"
    moe.renormalize = True  # Mixtral divides the two chosen probabilities by their sum
    moe.single_weight = "one"  # a one-expert token after renormalisation: weight 1
    moe.capacity_factor = 0.0  # dropless, as Mixtral
    moe.balance_loss_weight = 0.01  # the peer's router_aux_loss_coef is set to the same
    moe.z_loss_weight = 0.0  # Mixtral has no router z-loss
    moe.dispatch = "auto"

    t = c.train
    t.batch_size = 8
    t.seq_len = 256

    o = c.optimizer
    o.name = "adamw"

    if variant:
        _apply_variant(c, variant)
    return c


def _apply_variant(c: ConfigDict, variant: str) -> None:
    if variant == "dense":
        c.model.moe.num_experts = 0
    elif variant in ("top1", "adaptive", "top2"):
        c.model.moe.gating = variant
    else:
        raise ValueError(
            f"configs/tiny_mixtral.py: unknown variant {variant!r} ({' | '.join(VARIANTS)})"
        )
