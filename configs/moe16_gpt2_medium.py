"""Adaptive-gating MoE with 16 experts at GPT-2-medium scale (the adaptive-gating paper).

The paper turned the FFNs of Hugging Face models (BERT-base, GPT-2, DialoGPT-medium, ...)
into 16-expert MoE layers trained with its adaptive gate: a token goes to its top-2 experts
when p1 - p2 < 0.1 after renormalising the two, else to its top-1 expert; no capacity limit;
balance loss 0.01 on top-1 choices. It does not say that only some FFNs were converted, so
every layer here is an MoE layer (model.moe.every = 1). The body is GPT-2 medium: 24 layers,
d_model 1024, 16 heads of 64 (multi-head), GELU. Differences from GPT-2 kept on purpose:
rotary positions instead of learned ones, RMSNorm, and gated experts whose width 2816 gives
each expert the parameter count of GPT-2's 4096-wide ungated MLP (3 x 2816 ~ 2 x 4096).
3.5B parameters in all (16 experts x 24 layers), 0.5B of them active per token.

Target: TPU v5p-8 (4 chips): 4 experts per chip (mesh.expert = 4), dense weights
replicated, the batch split over the same 4 chips in 8 micro-batches (train.grad_accum).

Check it fits (on any machine with `pip install 'jaxmoe[tpu]'`, no TPU needed):
    jaxmoe compile --config configs/moe16_gpt2_medium.py --topology v5p-8
Train (wikitext-103 through TFDS; a 32768-piece SentencePiece model is fitted first):
    jaxmoe train --config configs/moe16_gpt2_medium.py --workdir runs/moe16_gpt2_medium
Variants: `:top1`, `:top2` (the paper's baselines; top-2 balanced on top-1 choices as GShard's
implementation does), `:dense` (no experts, FFN 2816). As the paper: no router z-loss, and
evaluation with top-1 routing (`model.moe.eval_gating`).
"""

from ml_collections import ConfigDict

from jaxmoe.config.defaults import base_config

VARIANTS = ("top1", "top2", "dense")


def get_config(variant: str | None = None) -> ConfigDict:
    c = base_config()
    m = c.model
    m.arch = "decoder"
    m.vocab_size = 32768  # the SentencePiece model fitted on the corpus (data.vocab_size)
    m.num_layers = 24
    m.d_model = 1024
    m.num_heads = 16
    m.num_kv_heads = 16  # multi-head, as GPT-2
    m.head_dim = 64
    m.ffn_dim = 2816  # dense FFN width (used only by the :dense variant)
    m.activation = "gelu"
    m.tie_embeddings = True  # GPT-2 ties its input and output embeddings
    m.dtype = "bfloat16"
    m.remat = "full"
    m.scan_layers = True  # one scanned block: compile time independent of depth

    moe = m.moe
    moe.num_experts = 16
    moe.every = 1  # every FFN is an MoE layer
    moe.ffn_dim = 2816
    moe.gating = "adaptive"
    moe.threshold = 0.1  # the paper's T for all tasks in its main table
    moe.gap_normalization = "top2"
    moe.capacity_factor = 0.0  # dropless, as in the paper
    moe.balance_loss_weight = 0.01
    moe.z_loss_weight = 0.0  # the paper uses no router z-loss
    # The paper reports evaluation "with top-1 gating"; read here as top-1 routing at
    # evaluation for every variant (the wording allows other readings: docs/moe.md).
    moe.eval_gating = "top1"

    t = c.train
    t.batch_size = 256
    # 8 micro-batches of 32 sequences: 8K tokens per chip at a time. The whole batch at once
    # (65K tokens per chip) needs the dropless expert buffers and activations of all of it;
    # with 8 the step compiles for v5p-8 at a peak of 55.1 of 95.7 GiB per chip.
    t.grad_accum = 8
    t.seq_len = 1024  # GPT-2's context
    t.steps = 100_000
    t.log_every = 100
    t.eval_every = 2000
    t.checkpoint_every = 2000

    o = c.optimizer
    o.name = "adamw"
    o.learning_rate = 3e-4
    o.schedule = "cosine"
    o.warmup_steps = 2000
    o.weight_decay = 0.1

    c.data.source = "tfds:wikitext/wikitext-103-raw-v1"
    c.data.vocab_size = 32768

    ms = c.mesh
    ms.data, ms.fsdp, ms.tensor, ms.expert = 1, 1, 1, 4  # 4 experts per chip

    if variant == "dense":
        moe.num_experts = 0
        ms.data, ms.expert = -1, 1
    elif variant in ("top1", "top2"):
        moe.gating = variant
        # GShard's implementation balances its top-2 baseline on top-1 choices only.
        moe.balance_fractions = "top1"
    elif variant:
        raise ValueError(
            f"configs/moe16_gpt2_medium.py: unknown variant {variant!r} (top1 | top2 | dense)"
        )
    return c
