"""Kimi K2 (1T): 1.03T parameters (as transformers counts its DeepseekV3 model of this
config), 32B active per token, trained with MuonClip.

Kimi-K2's architecture (moonshotai/Kimi-K2-Instruct's config.json, a DeepSeek-V3 model
type): 61 layers, d_model 7168, 64 heads of multi-head latent attention (queries through a
1536-wide latent, keys and values from a 512-wide latent, 128 non-rotary + 64 rotary
query/key dims per head, values of 128), YaRN rotary (base 5e4, factor 32 over 4096
positions, beta 1 / 1, mscale and mscale_all_dim 1.0), RMSNorm eps 1e-6; layer 0 a dense
SwiGLU FFN of 18432 (first_k_dense_replace 1), layers 1-60 MoE layers of 384 routed
SwiGLU experts of 2048 plus one shared expert of 2048: sigmoid scores, the top 8 chosen
with a per-expert selection bias (no expert groups), renormalised and scaled by 2.827;
untied output layer, vocabulary 163840, no multi-token prediction. Optimizer as the K2
report's pre-training: MuonClip (`optimizer.name=muon` with `optimizer.qk_clip=100`, the
update RMS matched to AdamW's at 0.2; docs/muon.md), weight decay 0.1, peak learning rate
2e-4, 4096-token sequences.

Target: TPU v5p-1024 (512 chips), 2 sequences of 4096 tokens per chip (1024 per step),
bf16 compute with f32 weights, full remat, fsdp 32 x expert 16 (24 experts per group),
layers scanned behind the dense first layer, the output loss 1024 positions at a time.

Check it fits (any machine with `pip install 'jaxmoe[tpu]'`, no TPU needed):
    jaxmoe compile --config configs/kimi_k2.py --topology v5p-1024
Convert the checkpoint: `jaxmoe convert hf moonshotai/Kimi-K2-Base ...` (its config.json
is model_type deepseek_v3; bf16 safetensors). Variant `:tiny` is the same design at test
size.
"""

from ml_collections import ConfigDict

from jaxmoe.config.defaults import base_config

VARIANTS = ("tiny",)


def get_config(variant: str | None = None) -> ConfigDict:
    c = base_config()
    m = c.model
    m.arch = "decoder"
    m.vocab_size = 163840
    m.num_layers = 61
    m.d_model = 7168
    m.num_heads = 64
    m.num_kv_heads = 64  # MLA: every head its own key and value, rebuilt from the latent
    m.attention = "mla"
    m.q_lora_rank = 1536
    m.kv_lora_rank = 512
    m.qk_nope_head_dim = 128
    m.qk_rope_head_dim = 64
    m.v_head_dim = 128
    m.head_dim = 192  # qk_nope_head_dim + qk_rope_head_dim
    m.ffn_dim = 18432  # the dense first layer
    m.activation = "silu"
    m.norm_eps = 1e-6
    m.rope_theta = 50000.0
    m.rope_type = "yarn"
    m.rope_factor = 32.0
    m.rope_original_max_len = 4096
    m.rope_beta_fast = 1.0
    m.rope_beta_slow = 1.0
    m.rope_mscale = 1.0
    m.rope_mscale_all_dim = 1.0
    m.tie_embeddings = False
    m.dtype = "bfloat16"
    m.remat = "full"
    m.scan_layers = True  # layer 0 unrolled ahead of one scanned MoE body

    moe = m.moe
    moe.num_experts = 384
    moe.every = 1
    moe.first_dense_layers = 1
    moe.ffn_dim = 2048
    moe.gating = "topk"
    moe.top_k = 8
    moe.router_scoring = "sigmoid"
    moe.selection_bias = True
    moe.bias_update_rate = 0.001
    moe.n_group = 1
    moe.topk_group = 1
    moe.renormalize = True
    moe.routed_scaling_factor = 2.827
    moe.num_shared_experts = 1
    moe.shared_ffn_dim = 2048
    moe.capacity_factor = 0.0  # dropless
    moe.balance_loss_weight = 0.0  # auxiliary-loss-free
    moe.z_loss_weight = 0.0
    moe.ep_buffer_factor = 0.5

    t = c.train
    t.batch_size = 1024  # 2 sequences per chip on 512 chips
    t.seq_len = 4096
    t.grad_accum = 1
    t.loss_chunk = 1024
    t.steps = 100_000
    t.log_every = 50
    t.eval_every = 1000
    t.checkpoint_every = 1000

    o = c.optimizer
    o.name = "muon"
    o.qk_clip = 100.0  # MuonClip's tau
    o.muon_rms = 0.2
    o.learning_rate = 2e-4
    o.schedule = "cosine"
    o.warmup_steps = 500
    o.weight_decay = 0.1
    o.grad_clip_norm = 1.0

    c.data.source = "tfds:c4/en:3.1.0"
    c.data.tokenizer = "kimi_k2/tokenizer.json"

    ms = c.mesh
    ms.data, ms.fsdp, ms.tensor, ms.expert = 1, -1, 1, 16  # fsdp takes the other 32 of 512

    if variant == "tiny":
        _tiny(c)
    elif variant:
        raise ValueError(f"configs/kimi_k2.py: unknown variant {variant!r} (tiny)")
    return c


def _tiny(c: ConfigDict) -> None:
    """The same design (MLA with low-rank queries and YaRN, a dense first layer, a shared
    expert, sigmoid routing with selection biases, MuonClip) at test size."""
    m = c.model
    m.vocab_size = 512
    m.num_layers = 3
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
    m.moe.num_experts = 24
    m.moe.ffn_dim = 32
    m.moe.shared_ffn_dim = 32
    m.moe.top_k = 4
    c.train.batch_size = 8
    c.train.seq_len = 64
    c.train.loss_chunk = 0
    c.train.steps = 20
    c.data.source = "embedded"
    c.data.tokenizer = ""
    c.mesh.expert = 1
