"""T5.1.1-XXL with GQA-8 decoder attention, uptrained as in the GQA paper (its main model).

9.7B parameters (11.3B as MHA): d_model 4096, 64 heads of 64, 24 encoder + 24 decoder
layers, gated-GELU FFN of 10240, vocabulary 32128 (T5's 32000 SentencePiece pieces + 100
sentinels, padded). The decoder's self- and cross-attention have 8 KV heads (GQA-8); the
encoder stays multi-head. Uptraining continues the T5 pre-training recipe for 5% of its 1M
steps: span corruption, batch 2048 x 512 encoder tokens (114 decoder tokens), T5X's
Adafactor and rsqrt schedule continued from step 1M (the recipe `jaxmoe convert t5x` writes).

Target: TPU v5p-128 (64 chips), fully sharded data parallel over all 64 chips.

Check it fits (on any machine with `pip install 'jaxmoe[tpu]'`, no TPU needed):
    jaxmoe compile --config configs/t5_1_1_xxl_gqa8.py --topology v5p-128
Uptrain from T5.1.1-XXL converted to GQA-8 (`jaxmoe convert t5x`, then `jaxmoe convert gqa`
mean-pools each group's K/V heads), with T5's SentencePiece model copied from
gs://t5-data/vocabs/cc_all.32000/sentencepiece.model to t5_spm/ and C4 prepared for TFDS:
    jaxmoe train --config configs/t5_1_1_xxl_gqa8.py \\
        --config.train.init_from=ckpt/t5_1_1_xxl_gqa8 --workdir runs/t5_1_1_xxl_gqa8
Variant `:mha` keeps 64 KV heads in the decoder (the paper's MHA-XXL baseline).
"""

from ml_collections import ConfigDict

from jaxmoe.config.defaults import base_config
from jaxmoe.conversions.t5x.convert import t5_1_1_recipe

VARIANTS = ("mha",)
T5_1_1_STEPS = 1_000_000  # T5.1.1's pre-training steps


def t5_1_1(c: ConfigDict) -> ConfigDict:
    """The T5.1.1 architecture and pre-training recipe shared by every size."""
    m = c.model
    m.arch = "encoder_decoder"
    m.vocab_size = 32128  # T5's SentencePiece (32000) + 100 sentinels, padded to 128
    m.activation = "gelu"  # gated GELU (tanh approximation), T5.1.1
    m.rope_theta = 0.0  # T5 uses relative position buckets, not rotary positions
    m.relpos_buckets = 32
    m.relpos_max_distance = 128
    m.tie_embeddings = False  # T5.1.1 unties the output layer
    m.dtype = "bfloat16"  # compute in bf16; parameters and optimizer state stay f32
    m.remat = "full"  # recompute each block in the backward pass
    m.scan_layers = True  # one scanned block per stack: compile time independent of depth
    m.moe.num_experts = 0  # dense FFNs

    t = c.train
    t.batch_size = 2048  # T5 pre-training: 2048 sequences
    t.seq_len = 512  # encoder tokens; span corruption makes 114 decoder tokens
    t.steps = T5_1_1_STEPS // 20  # uptraining: 5% of the pre-training steps (GQA paper)
    t.log_every = 100
    t.eval_every = 5000
    t.checkpoint_every = 5000

    # T5.1.1's pre-training recipe in T5X, as `jaxmoe convert t5x` writes it into converted
    # checkpoints: T5X's Adafactor (factored second moments on each kernel's 2-D view,
    # decay 0.8, update clipping 1.0, parameter scaling), lr 1 / sqrt(max(step, 10k)), no
    # weight decay or global clipping, output-logit z-loss 1e-4, span corruption 15% / 3.
    t5_1_1_recipe(c)
    # Uptraining continues that schedule where T5.1.1 stopped (1M steps: lr 1e-3, falling
    # under 3% over the 50k uptraining steps), instead of restarting its warmup.
    c.optimizer.start_step = T5_1_1_STEPS

    d = c.data
    d.source = "tfds:c4/en:3.1.0"  # T5's pre-training corpus
    d.train_split = "train"
    d.eval_split = "validation"
    d.tokenizer = "t5_spm/sentencepiece.model"  # T5's 32000-piece vocabulary
    return c


def get_config(variant: str | None = None) -> ConfigDict:
    c = t5_1_1(base_config())
    m = c.model
    m.num_layers = 24  # decoder layers
    m.num_encoder_layers = 24
    m.d_model = 4096
    m.num_heads = 64
    m.head_dim = 64
    m.num_kv_heads = 8  # GQA-8 in decoder self- and cross-attention
    m.encoder_num_kv_heads = 0  # encoder: multi-head (the paper converts only the decoder)
    m.ffn_dim = 10240

    c.train.grad_accum = 1
    ms = c.mesh
    ms.data, ms.fsdp, ms.tensor, ms.expert = 1, -1, 1, 1  # FSDP over every chip
    if variant == "mha":
        m.num_kv_heads = 64
    elif variant:
        raise ValueError(f"configs/t5_1_1_xxl_gqa8.py: unknown variant {variant!r} (mha)")
    return c
