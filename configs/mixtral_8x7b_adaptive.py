"""Mixtral-8x7B with the adaptive gate: 47B parameters, 13B active at top-2.

Mixtral's architecture: 32 layers, d_model 4096, 32 query heads and 8 KV heads of 128
(GQA-4), rotary base 1e6, RMSNorm eps 1e-5, 8 SwiGLU experts of 14336 in every layer,
untied output layer, vocabulary 32000. The gate is the adaptive-gating paper's instead of
Mixtral's plain top-2: two experts only when the renormalised top-2 gap is under 0.1,
dropless. Starting from Mixtral's weights (`jaxmoe convert hf`) makes this an adaptive
re-gating run; from scratch it is a pre-training run of that shape.

Target: TPU v5p-256 (128 chips): experts split 8 ways (one expert per chip group,
mesh.expert = 8), every weight sharded 16 ways over mesh.fsdp, the batch over all 128 in 8
micro-batches of one 2048-token sequence per chip (train.grad_accum).

Check it fits (on any machine with `pip install 'jaxmoe[tpu]'`, no TPU needed):
    jaxmoe compile --config configs/mixtral_8x7b_adaptive.py --topology v5p-256
Train (Mixtral's SentencePiece model copied to mixtral/tokenizer.model):
    jaxmoe train --config configs/mixtral_8x7b_adaptive.py --workdir runs/mixtral_adaptive
Variant `:top2` is Mixtral's own gate (the baseline).
"""

from ml_collections import ConfigDict

from jaxmoe.config.defaults import base_config

VARIANTS = ("top2",)


def get_config(variant: str | None = None) -> ConfigDict:
    c = base_config()
    m = c.model
    m.arch = "decoder"
    m.vocab_size = 32000
    m.num_layers = 32
    m.d_model = 4096
    m.num_heads = 32
    m.num_kv_heads = 8
    m.head_dim = 128
    m.ffn_dim = 14336  # unused: every layer is an MoE layer
    m.activation = "silu"  # SwiGLU experts
    m.norm_eps = 1e-5
    m.rope_theta = 1e6
    m.tie_embeddings = False
    m.dtype = "bfloat16"
    m.remat = "full"
    m.scan_layers = True  # one scanned block: compile time independent of depth

    moe = m.moe
    moe.num_experts = 8
    moe.every = 1
    moe.ffn_dim = 14336
    moe.gating = "adaptive"
    moe.threshold = 0.1
    moe.gap_normalization = "top2"
    moe.renormalize = True  # Mixtral renormalises its two combine weights
    moe.capacity_factor = 0.0  # dropless
    moe.balance_loss_weight = 0.01
    # Receive buffer of half the balanced load (2048 rows per chip at 2048 tokens): the
    # dropless exchange then runs in rounds (more, shorter exchanges per layer). The step
    # measured 10.82 GiB per chip on v5p-256 this way against 11.05 padded and 12.33 at the
    # default factor 2; since the weight casts stay in the layer loop, 10.37 vs 10.36
    # padded (libtpu 0.0.42.1; docs/results/2026-12-01_maxtext_compile.md).
    moe.ep_buffer_factor = 0.5

    t = c.train
    # 2M tokens per step as 1024 x 2048, in 8 micro-batches: one 2048-token sequence per chip
    # at a time. One sequence per chip without micro-batches (batch_size=128, grad_accum=1)
    # compiles for v5p-256 at 10.40 GiB per chip with libtpu 0.0.42.1, 7.79 GiB with libtpu
    # 0.0.52 (MaxText: 9.09), and at 12.16 / 9.06 GiB with 4096-token sequences
    # (docs/results/2026-12-01_maxtext_compile.md).
    t.batch_size = 1024
    t.seq_len = 2048
    t.grad_accum = 8
    t.steps = 20_000
    t.log_every = 50
    t.eval_every = 1000
    t.checkpoint_every = 1000

    o = c.optimizer
    o.name = "adamw"
    o.learning_rate = 1e-4
    o.schedule = "cosine"
    o.warmup_steps = 500
    o.weight_decay = 0.1

    c.data.source = "tfds:c4/en:3.1.0"
    c.data.tokenizer = "mixtral/tokenizer.model"

    ms = c.mesh
    ms.data, ms.fsdp, ms.tensor, ms.expert = 1, -1, 1, 8  # fsdp takes the other 16

    if variant == "top2":
        moe.gating = "top2"
    elif variant:
        raise ValueError(f"configs/mixtral_8x7b_adaptive.py: unknown variant {variant!r} (top2)")
    return c
