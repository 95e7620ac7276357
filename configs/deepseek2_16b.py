"""DeepSeek-V2-Lite (16B): 15.7B parameters, 2.4B active, multi-head latent attention.

DeepSeek-V2-Lite's architecture (its Hugging Face config.json): 27 layers, d_model 2048,
16 heads with multi-head latent attention (full-rank queries, keys and values from a
512-wide latent, 128 non-rotary + 64 rotary query/key dims per head, values of 128), YaRN
rotary (base 1e4, factor 40 over 4096 positions, beta 32 / 1, mscale and mscale_all_dim
0.707), RMSNorm eps 1e-6; layer 0 a dense SwiGLU FFN of 10944 (first_k_dense_replace 1),
layers 1-26 MoE layers of 64 routed SwiGLU experts of 1408, top-6 softmax probabilities
not renormalised, routed scaling 1.0, plus 2 shared experts of 1408 (one FFN of 2816);
auxiliary loss 0.001, untied output layer, vocabulary 102400.

Target: TPU v5p-32 (16 chips): experts split 8 ways (mesh.expert = 8), every weight sharded
2 ways over mesh.fsdp, 64 sequences of 4096 tokens per step (4 per chip, no
micro-batches), bf16 compute with f32 weights, AdamW, full remat. Layers scanned
(model.scan_layers): the dense first layer runs unrolled as the stack's head, the 26 MoE
layers under one jax.lax.scan. Python-unrolled, the compiled step's peak HBM grew by 2.8
GiB per MoE layer (the scheduler kept per-layer exchange state live across layers) to
76.67 GiB on v5p-32, against MaxText's 45.49 GiB (it scans); scanned it is 26.45 GiB,
same compiler (docs/results/2026-12-03_deepseek2_scanned.md).

Check it fits (any machine with `pip install 'jaxmoe[tpu]'`, no TPU needed):
    jaxmoe compile --config configs/deepseek2_16b.py --topology v5p-32
Side by side with MaxText's deepseek2-16b: `python -m benchmarks pod_compile_peer --cases
deepseek2_16b`. Variant `:tiny` is the same design at test size.
"""

from ml_collections import ConfigDict

from jaxmoe.config.defaults import base_config

VARIANTS = ("tiny",)


def get_config(variant: str | None = None) -> ConfigDict:
    c = base_config()
    m = c.model
    m.arch = "decoder"
    m.vocab_size = 102400
    m.num_layers = 27
    m.d_model = 2048
    m.num_heads = 16
    m.num_kv_heads = 16  # MLA: every head its own key and value, rebuilt from the latent
    m.attention = "mla"
    m.q_lora_rank = 0  # full-rank queries (the Lite model)
    m.kv_lora_rank = 512
    m.qk_nope_head_dim = 128
    m.qk_rope_head_dim = 64
    m.v_head_dim = 128
    m.head_dim = 192  # qk_nope_head_dim + qk_rope_head_dim
    m.ffn_dim = 10944  # the dense first layer
    m.activation = "silu"
    m.norm_eps = 1e-6
    m.rope_theta = 10000.0
    m.rope_type = "yarn"
    m.rope_factor = 40.0
    m.rope_original_max_len = 4096
    m.rope_beta_fast = 32.0
    m.rope_beta_slow = 1.0
    m.rope_mscale = 0.707
    m.rope_mscale_all_dim = 0.707
    m.tie_embeddings = False
    m.dtype = "bfloat16"
    m.remat = "full"
    # One scanned MoE layer body in the program: the compiler cannot keep one layer's
    # exchange buffers live across the others (unrolled: +2.8 GiB peak per MoE layer), and
    # compile time stops growing with depth. Layer 0 (dense) is unrolled ahead of the scan.
    m.scan_layers = True

    moe = m.moe
    moe.num_experts = 64
    moe.every = 1
    moe.first_dense_layers = 1
    moe.ffn_dim = 1408
    moe.gating = "topk"
    moe.top_k = 6
    moe.router_scoring = "softmax"
    moe.renormalize = False  # norm_topk_prob false: the raw top-6 probabilities
    moe.single_weight = "prob"
    moe.routed_scaling_factor = 1.0
    moe.num_shared_experts = 2
    moe.shared_ffn_dim = 1408
    moe.capacity_factor = 0.0  # dropless
    # Receive buffer of the ragged exchange: half the balanced load (49152 rows of the
    # 98304 a device's 16384 tokens x 6 slots make), so a step takes at least 2 rounds, the
    # overflow of each round sent in the next (dropless: same values). With the default 2.0
    # each round's [196608, 2048] rows cost 768 MiB a copy. TPU v5p-32 AOT, 3 layers: peak
    # HBM 28.29 GiB at 2.0, 13.29 GiB at 0.5 (and stack.py's prevent_cse), per
    # docs/results/2026-12-02_deepseek2_peak_proxies.md.
    moe.ep_buffer_factor = 0.5
    moe.balance_loss_weight = 0.001  # aux_loss_alpha
    moe.z_loss_weight = 0.0

    t = c.train
    t.batch_size = 64  # 4 sequences per chip on 16 chips, one micro-batch
    t.seq_len = 4096
    t.grad_accum = 1
    t.steps = 10_000
    t.log_every = 50
    t.eval_every = 1000
    t.checkpoint_every = 1000

    o = c.optimizer
    o.name = "adamw"
    o.learning_rate = 3e-5
    o.schedule = "cosine"
    o.warmup_steps = 200
    o.weight_decay = 0.1

    c.data.source = "tfds:c4/en:3.1.0"
    c.data.tokenizer = "deepseek2/tokenizer.json"

    ms = c.mesh
    ms.data, ms.fsdp, ms.tensor, ms.expert = 1, -1, 1, 8  # fsdp takes the other 2 of 16

    if variant == "tiny":
        _tiny(c)
    elif variant:
        raise ValueError(f"configs/deepseek2_16b.py: unknown variant {variant!r} (tiny)")
    return c


def _tiny(c: ConfigDict) -> None:
    """The same design (MLA with YaRN, a dense first layer, shared experts, raw top-k of
    many small experts) at a size CPU tests build in seconds."""
    m = c.model
    m.vocab_size = 512
    m.num_layers = 3
    m.d_model = 64
    m.num_heads = 4
    m.num_kv_heads = 4
    m.kv_lora_rank = 32
    m.qk_nope_head_dim = 16
    m.qk_rope_head_dim = 8
    m.v_head_dim = 16
    m.head_dim = 24
    m.ffn_dim = 128
    m.rope_original_max_len = 64
    m.dtype = "float32"
    m.moe.num_experts = 16
    m.moe.ffn_dim = 32
    m.moe.shared_ffn_dim = 32
    m.moe.top_k = 4
    c.train.batch_size = 8
    c.train.seq_len = 64
    c.train.steps = 20
    c.data.source = "embedded"
    c.data.tokenizer = ""
    c.mesh.expert = 1
