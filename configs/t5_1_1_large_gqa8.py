"""T5.1.1-Large with GQA-8 decoder attention, uptrained as in the GQA paper.

733M parameters (783M as MHA): d_model 1024, 16 heads of 64, 24 encoder + 24 decoder
layers, gated-GELU FFN of 2816, vocabulary 32128. Decoder self- and cross-attention have 8
KV heads (groups of two query heads); the encoder stays multi-head. The recipe (span
corruption, batch 2048 x 512, T5X's Adafactor and rsqrt schedule continued from step 1M,
5% of 1M steps) is the XXL config's:
configs/t5_1_1_xxl_gqa8.py.

Target: TPU v5p-32 (16 chips), fully sharded data parallel over all 16 chips.

Check it fits (on any machine with `pip install 'jaxmoe[tpu]'`, no TPU needed):
    jaxmoe compile --config configs/t5_1_1_large_gqa8.py --topology v5p-32
Uptrain from T5.1.1-Large converted to GQA-8 (`jaxmoe convert t5x`, then `jaxmoe convert
gqa`), with T5's SentencePiece model in t5_spm/ as for XXL:
    jaxmoe train --config configs/t5_1_1_large_gqa8.py \\
        --config.train.init_from=ckpt/t5_1_1_large_gqa8 --workdir runs/t5_1_1_large_gqa8
Variant `:mha` keeps 16 KV heads in the decoder (the paper's MHA-Large baseline).
"""

import importlib.util
from pathlib import Path

from ml_collections import ConfigDict

from jaxmoe.config.defaults import base_config

VARIANTS = ("mha",)


def _t5_1_1_recipe():
    """`t5_1_1` from the XXL config next to this file (configs/ is not a package)."""
    path = Path(__file__).with_name("t5_1_1_xxl_gqa8.py")
    spec = importlib.util.spec_from_file_location("t5_1_1_xxl_gqa8", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.t5_1_1


def get_config(variant: str | None = None) -> ConfigDict:
    c = _t5_1_1_recipe()(base_config())
    m = c.model
    m.num_layers = 24
    m.num_encoder_layers = 24
    m.d_model = 1024
    m.num_heads = 16
    m.head_dim = 64
    m.num_kv_heads = 8  # GQA-8 in decoder self- and cross-attention
    m.encoder_num_kv_heads = 0  # encoder: multi-head
    m.ffn_dim = 2816

    ms = c.mesh
    ms.data, ms.fsdp, ms.tensor, ms.expert = 1, -1, 1, 1  # FSDP over every chip
    if variant == "mha":
        m.num_kv_heads = 16
    elif variant:
        raise ValueError(f"configs/t5_1_1_large_gqa8.py: unknown variant {variant!r} (mha)")
    return c
