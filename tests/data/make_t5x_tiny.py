"""Writes tests/data/t5x_tiny/checkpoint_0: a randomly initialised tiny T5.1.1 as a T5X
checkpoint (written by `export t5x`), so the README's T5X examples run from the repository.

Model: vocab 2048 (the default data's tokenizer has 1124 pieces), d_model 8, 4 heads of 3,
gated-GELU FFN 16, 2 + 2 layers, 32 relative-position buckets (the shape of T5X's own test
checkpoint, with a smaller vocabulary).

    PYTHONPATH=. python tests/data/make_t5x_tiny.py
"""

import shutil
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxmoe.checkpoints.manager import save_params
from jaxmoe.conversions.t5x.convert import build_config
from jaxmoe.conversions.t5x.exporter import export_t5x
from jaxmoe.models import build_model
from jaxmoe.models.spec import str_keys
from jaxmoe.models.stack import unrolled_config

HERE = Path(__file__).resolve().parent
MODEL = {
    "arch": "encoder_decoder", "vocab_size": 2048, "d_model": 8, "num_layers": 2,
    "num_encoder_layers": 2, "num_heads": 4, "num_kv_heads": 4, "encoder_num_kv_heads": 0,
    "head_dim": 3, "ffn_dim": 16, "activation": "gelu", "norm_eps": 1e-6, "rope_theta": 0.0,
    "tie_embeddings": False, "relpos_buckets": 32, "relpos_max_distance": 128,
}  # fmt: skip


def main(out: Path = HERE / "t5x_tiny") -> Path:
    config = build_config(MODEL)
    model = build_model(unrolled_config(config.model), rngs=nnx.Rngs(0))
    _, state = nnx.split(model, nnx.Param)
    params = jax.tree.map(np.asarray, str_keys(nnx.to_pure_dict(state)))  # host arrays
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        save_params(f"{tmp}/jaxmoe", params, config)
        return export_t5x(f"{tmp}/jaxmoe", out)


if __name__ == "__main__":
    print(main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "t5x_tiny"))
