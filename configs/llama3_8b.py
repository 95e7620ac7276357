"""Llama-3-8B-sized dense model for long sequences: 65,536-token training with mesh.context.

Llama-3-8B's architecture (its Hugging Face config.json): 32 layers, d_model 4096, 32 query
heads and 8 KV heads of 128 (GQA-4), SwiGLU FFN of 14336, RMSNorm eps 1e-5, rotary base
500000, untied output layer, vocabulary 128256. 8.03B parameters.

Target: TPU v5p-64 (32 chips), 4 sequences of 65,536 tokens per step: each sequence split
over mesh.context = 8 chips (load-balanced causal chunks, keys/values gathered;
docs/long_context.md), weights sharded over fsdp 4 x context 8, bf16 compute with f32
weights, AdamW, full remat, scanned layers.

Check it fits (no TPU needed):
    jaxmoe compile --config configs/llama3_8b.py --topology v5p-64
Without the context axis (one whole 65,536-token sequence per chip, fsdp 32):
    jaxmoe compile --config configs/llama3_8b.py:no_context --topology v5p-64
Side by side with MaxText's llama3-8b (ici_context_parallelism=8): `python -m benchmarks
pod_compile_peer --cases llama3_8b_65k`. Variant `:tiny` is the same design at test size.
"""

from ml_collections import ConfigDict

from jaxmoe.config.defaults import base_config

VARIANTS = ("tiny", "no_context")


def get_config(variant: str | None = None) -> ConfigDict:
    c = base_config()
    m = c.model
    m.arch = "decoder"
    m.vocab_size = 128256
    m.num_layers = 32
    m.d_model = 4096
    m.num_heads = 32
    m.num_kv_heads = 8
    m.head_dim = 128
    m.ffn_dim = 14336
    m.activation = "silu"
    m.norm_eps = 1e-5
    m.rope_theta = 500000.0
    m.tie_embeddings = False
    m.dtype = "bfloat16"
    m.remat = "full"
    m.scan_layers = True
    m.moe.num_experts = 0  # dense

    t = c.train
    t.batch_size = 4  # one sequence per 8-chip context group
    t.seq_len = 65536
    t.grad_accum = 1
    t.steps = 10_000
    t.log_every = 10
    t.eval_every = 1000
    t.checkpoint_every = 500
    # The output layer 8,192 positions at a time: with the whole [65,536 x 128,256] f32 logits
    # at once the step peaked at 12.38 GiB per chip on v5p-64, in chunks at 8.23 GiB.
    t.loss_chunk = 8192

    o = c.optimizer
    o.name = "adamw"
    o.learning_rate = 1e-5
    o.schedule = "cosine"
    o.warmup_steps = 100
    o.weight_decay = 0.1

    c.data.source = "tfds:c4/en:3.1.0"
    c.data.tokenizer = "llama3/tokenizer.json"

    ms = c.mesh
    ms.data, ms.fsdp, ms.context, ms.tensor, ms.expert = 1, -1, 8, 1, 1  # fsdp: the other 4

    if variant == "tiny":
        _tiny(c)
    elif variant == "no_context":
        ms.context = 1
        t.batch_size = 32  # one whole sequence per chip
    elif variant:
        raise ValueError(f"configs/llama3_8b.py: unknown variant {variant!r} (tiny | no_context)")
    return c


def _tiny(c: ConfigDict) -> None:
    m = c.model
    m.vocab_size = 0  # the embedded corpus's tokenizer
    m.num_layers = 2
    m.d_model = 64
    m.num_heads = 4
    m.num_kv_heads = 2
    m.head_dim = 16
    m.ffn_dim = 128
    m.dtype = "float32"
    c.train.batch_size = 2
    c.train.seq_len = 64
    c.train.loss_chunk = 0
    c.train.steps = 20
    c.data.source = "embedded"
    c.data.tokenizer = ""
    c.mesh.data, c.mesh.fsdp, c.mesh.context = -1, 1, 2
