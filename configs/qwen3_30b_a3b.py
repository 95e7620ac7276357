"""Qwen3-30B-A3B: 30.5B parameters, 3.3B active, 128 fine-grained experts of which 8 per token.

Qwen3-30B-A3B's architecture (its Hugging Face config.json): 48 layers, d_model 2048, 32
query heads and 4 KV heads of 128 (GQA-8; the heads are wider than d_model / heads), RMSNorm
of each query and key head before rotary (`qk_norm=head`), rotary base 1e6, RMSNorm eps
1e-6, every layer an MoE of 128 SwiGLU experts of 768 with no shared expert, softmax over
all 128 and the top 8 renormalised to sum to one (norm_topk_prob), router auxiliary loss
0.001 and no z-loss, untied output layer, vocabulary 151936. `jaxmoe convert hf` of the
checkpoint gives the same model keys.

Target: TPU v5p-64 (32 chips): experts split 8 ways (16 experts per chip group,
mesh.expert = 8), every weight sharded 4 ways over mesh.fsdp, 128 sequences of 4096 tokens
per step (4 per chip, no micro-batches), bf16 compute with f32 weights, AdamW, full remat.

Check it fits (any machine with `pip install 'jaxmoe[tpu]'`, no TPU needed):
    jaxmoe compile --config configs/qwen3_30b_a3b.py --topology v5p-64
Side by side with MaxText's qwen3-30b-a3b: `python -m benchmarks pod_compile_peer --cases
qwen3_30b_a3b`. Fine-tune from the checkpoint: `jaxmoe convert hf Qwen/Qwen3-30B-A3B ...`,
then train with `--config.train.init_from=...` (tokenizer.json as data.tokenizer).
Variant `:tiny` is the same design at test size (4 layers, d_model 64, 16 experts of 32,
top-4, vocab 512), which CPU tests build and train.
"""

from ml_collections import ConfigDict

from jaxmoe.config.defaults import base_config

VARIANTS = ("tiny",)


def get_config(variant: str | None = None) -> ConfigDict:
    c = base_config()
    m = c.model
    m.arch = "decoder"
    m.vocab_size = 151936
    m.num_layers = 48
    m.d_model = 2048
    m.num_heads = 32
    m.num_kv_heads = 4
    m.head_dim = 128
    m.ffn_dim = 6144  # unused: every layer is an MoE layer (intermediate_size)
    m.activation = "silu"  # SwiGLU experts
    m.norm_eps = 1e-6
    m.rope_theta = 1e6
    m.qk_norm = "head"
    m.tie_embeddings = False
    m.dtype = "bfloat16"
    m.remat = "full"
    m.scan_layers = True  # one scanned block: compile time independent of depth

    moe = m.moe
    moe.num_experts = 128
    moe.every = 1  # decoder_sparse_step 1, no mlp_only_layers
    moe.ffn_dim = 768
    moe.gating = "topk"
    moe.top_k = 8
    moe.renormalize = True  # norm_topk_prob
    moe.single_weight = "one"
    moe.router_scoring = "softmax"
    moe.capacity_factor = 0.0  # dropless
    moe.balance_loss_weight = 0.001  # router_aux_loss_coef
    moe.z_loss_weight = 0.0
    # The ragged exchange's receive buffer stays at 2x the balanced load (one round when the
    # router is balanced). On v5p-64 it is 262144 rows x 2048 per chip; 0.5 (as the Mixtral
    # config) cut the step's temporaries from 21.09 to 17.71 GiB per chip (libtpu 0.0.52
    # buffer assignment; docs/results/2026-12-02_qwen3_compile.md) at the price of two
    # rounds per layer even when balanced: --config.model.moe.ep_buffer_factor=0.5.

    t = c.train
    t.batch_size = 128  # 4 sequences per chip on 32 chips, one micro-batch
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
    c.data.tokenizer = "qwen3/tokenizer.json"

    ms = c.mesh
    ms.data, ms.fsdp, ms.tensor, ms.expert = 1, -1, 1, 8  # fsdp takes the other 4 of 32

    if variant == "tiny":
        _tiny(c)
    elif variant:
        raise ValueError(f"configs/qwen3_30b_a3b.py: unknown variant {variant!r} (tiny)")
    return c


def _tiny(c: ConfigDict) -> None:
    """The same design (QK-norm, GQA with heads wider than d_model / heads, renormalised
    top-k of many small experts) at a size CPU tests compile and train in seconds."""
    m = c.model
    m.vocab_size = 512
    m.num_layers = 4
    m.d_model = 64
    m.num_heads = 4
    m.num_kv_heads = 2
    m.head_dim = 32
    m.ffn_dim = 128
    m.dtype = "float32"
    m.moe.num_experts = 16
    m.moe.ffn_dim = 32
    m.moe.top_k = 4
    c.train.batch_size = 8
    c.train.seq_len = 64
    c.train.steps = 20
    c.data.source = "embedded"
    c.data.tokenizer = ""
    c.mesh.expert = 1
