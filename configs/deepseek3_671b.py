"""DeepSeek-V3 (671B): 671B parameters in the main model, 37B active per token, plus one
multi-token-prediction module (11.5B parameters of its own).

DeepSeek-V3's architecture (its Hugging Face config.json and technical report): 61 layers,
d_model 7168, 128 heads of multi-head latent attention (queries through a 1536-wide latent,
keys and values from a 512-wide latent, 128 non-rotary + 64 rotary query/key dims per head,
values of 128), YaRN rotary (base 1e4, factor 40 over 4096 positions, beta 32 / 1, mscale
and mscale_all_dim 1.0), RMSNorm eps 1e-6; layers 0-2 dense SwiGLU FFNs of 18432
(first_k_dense_replace 3), layers 3-60 MoE layers of 256 routed SwiGLU experts of 2048 plus
one shared expert of 2048: sigmoid scores, the top 8 chosen with a per-expert selection bias
among the experts of the 4 best of 8 groups (group-limited routing, groups ranked by their
two best biased scores), the chosen scores renormalised and scaled by 2.5; auxiliary-loss-
free balancing (the bias moves by 0.001 per step) plus a sequence-wise balance loss of
1e-4; untied output layer, vocabulary 129280. Multi-token prediction depth 1 with loss
weight 0.3 (`model.mtp_depth`, `model.mtp_weight`; docs/mtp.md), as DeepSeek trained it
for its first 10T tokens. Optimizer as the report's pre-training: AdamW (0.9, 0.95), weight
decay 0.1, peak learning rate 2.2e-4 after 2000 warmup steps, gradient clipping 1.0.

Target: TPU v5p-1024 (512 chips), MaxText's own deepseek3-671b step
(docs/guides/optimization/benchmark_and_performance.md): 2 sequences of 8192 tokens per chip
(1024 per step, no micro-batches), bf16 compute with f32 weights, AdamW, full remat. The
mesh is fsdp 32 x expert 16 (16 experts per expert-parallel group, every weight sharded 32
ways over fsdp and, for the dense weights, over expert too); `--config.mesh.expert=1`
gives MaxText's guide's fsdp 512. Layers scanned (the three dense layers unrolled as the
stack's head, the 58 MoE layers one scanned body), the output loss 1024 positions at a time
(`train.loss_chunk`: the f32 logits of a whole sequence would be 8.5 GB per chip).

Check it fits (any machine with `pip install 'jaxmoe[tpu]'`, no TPU needed):
    jaxmoe compile --config configs/deepseek3_671b.py --topology v5p-1024
Side by side with MaxText's deepseek3-671b, same compiler, back to back:
    python -m benchmarks pod_compile_peer --cases deepseek3_671b deepseek3_671b_fsdp512
Convert the checkpoint (MTP layer included): `jaxmoe convert hf deepseek-ai/DeepSeek-V3-Base
...` (bf16 safetensors). Variant `:tiny` is the same design at test size.
"""

from ml_collections import ConfigDict

from jaxmoe.config.defaults import base_config

VARIANTS = ("tiny",)


def get_config(variant: str | None = None) -> ConfigDict:
    c = base_config()
    m = c.model
    m.arch = "decoder"
    m.vocab_size = 129280
    m.num_layers = 61
    m.d_model = 7168
    m.num_heads = 128
    m.num_kv_heads = 128  # MLA: every head its own key and value, rebuilt from the latent
    m.attention = "mla"
    m.q_lora_rank = 1536
    m.kv_lora_rank = 512
    m.qk_nope_head_dim = 128
    m.qk_rope_head_dim = 64
    m.v_head_dim = 128
    m.head_dim = 192  # qk_nope_head_dim + qk_rope_head_dim
    m.ffn_dim = 18432  # the three dense layers
    m.activation = "silu"
    m.norm_eps = 1e-6
    m.rope_theta = 10000.0
    m.rope_type = "yarn"
    m.rope_factor = 40.0
    m.rope_original_max_len = 4096
    m.rope_beta_fast = 32.0
    m.rope_beta_slow = 1.0
    m.rope_mscale = 1.0
    m.rope_mscale_all_dim = 1.0
    m.tie_embeddings = False
    m.mtp_depth = 1
    m.mtp_weight = 0.3
    m.dtype = "bfloat16"
    m.remat = "full"
    m.scan_layers = True  # dense layers 0-2 unrolled ahead of one scanned MoE body

    moe = m.moe
    moe.num_experts = 256
    moe.every = 1
    moe.first_dense_layers = 3
    moe.ffn_dim = 2048
    moe.gating = "topk"
    moe.top_k = 8
    moe.router_scoring = "sigmoid"
    moe.selection_bias = True
    moe.bias_update_rate = 0.001  # the report's gamma for its first 14.3T tokens
    moe.sequence_balance_weight = 0.0001
    moe.n_group = 8
    moe.topk_group = 4
    moe.renormalize = True
    moe.routed_scaling_factor = 2.5
    moe.num_shared_experts = 1
    moe.shared_ffn_dim = 2048
    moe.capacity_factor = 0.0  # dropless
    moe.balance_loss_weight = 0.0  # auxiliary-loss-free
    moe.z_loss_weight = 0.0
    # Receive buffer of the ragged exchange: half the balanced load, the overflow of a
    # round sent in the next (dropless), as configs/deepseek2_16b.py measured.
    moe.ep_buffer_factor = 0.5

    t = c.train
    t.batch_size = 1024  # 2 sequences per chip on 512 chips, one micro-batch
    t.seq_len = 8192
    t.grad_accum = 1
    t.loss_chunk = 1024
    t.steps = 100_000
    t.log_every = 50
    t.eval_every = 1000
    t.checkpoint_every = 1000

    o = c.optimizer
    o.name = "adamw"
    o.learning_rate = 2.2e-4
    o.schedule = "cosine"
    o.warmup_steps = 2000
    o.b1, o.b2 = 0.9, 0.95
    o.weight_decay = 0.1
    o.grad_clip_norm = 1.0

    c.data.source = "tfds:c4/en:3.1.0"
    c.data.tokenizer = "deepseek3/tokenizer.json"

    ms = c.mesh
    ms.data, ms.fsdp, ms.tensor, ms.expert = 1, -1, 1, 16  # fsdp takes the other 32 of 512

    if variant == "tiny":
        _tiny(c)
    elif variant:
        raise ValueError(f"configs/deepseek3_671b.py: unknown variant {variant!r} (tiny)")
    return c


def _tiny(c: ConfigDict) -> None:
    """The same design (MLA with low-rank queries and YaRN, three dense layers, a shared
    expert, sigmoid group-limited routing with selection biases, one MTP module) at a size
    CPU tests build in seconds."""
    m = c.model
    m.vocab_size = 512
    m.num_layers = 5
    m.d_model = 64
    m.num_heads = 4
    m.num_kv_heads = 4
    m.q_lora_rank = 24
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
    m.moe.n_group = 4
    m.moe.topk_group = 2
    m.moe.top_k = 4
    c.train.batch_size = 8
    c.train.seq_len = 64
    c.train.loss_chunk = 0
    c.train.steps = 20
    c.data.source = "embedded"
    c.data.tokenizer = ""
    c.mesh.expert = 1
