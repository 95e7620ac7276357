"""Shared tiny configs and synthetic batches for the tests."""

import contextlib

import jax
import numpy as np

from jaxmoe.config.loading import load_config

CONFIG = "configs/default.py"
# A tiny T5 v1.1-style encoder-decoder (dense, relative position buckets): tiny_config(*TINY_T5)
TINY_T5 = (
    "model.arch=encoder_decoder",
    "model.moe.num_experts=0",
    "model.activation=gelu",
    "model.rope_theta=0.0",
    "model.relpos_buckets=8",
    "model.relpos_max_distance=16",
)


def tiny_config(*overrides: str, variant: str = ""):
    """The default config shrunk to compile and run in seconds (a typed JobConfig)."""
    return load_config(
        CONFIG + (f":{variant}" if variant else ""),
        [
            "model.vocab_size=128",
            "model.num_layers=2",
            "model.d_model=32",
            "model.num_heads=4",
            "model.num_kv_heads=2",
            "model.head_dim=8",
            "model.ffn_dim=64",
            "model.moe.ffn_dim=32",
            "model.moe.block_size=8",
            "train.batch_size=8",
            "train.seq_len=16",
            "train.steps=4",
            "optimizer.warmup_steps=1",
            "data.vocab_size=512",
            *overrides,
        ],
    )


def synthetic_batches(config, n: int, seed: int = 0) -> list[dict]:
    """Random token batches with a learnable pattern (next token = token + 1 mod V)."""
    rng = np.random.default_rng(seed)
    b, l, v = config.train.batch_size, config.train.seq_len, config.model.vocab_size
    batches = []
    for _ in range(n):
        start = rng.integers(0, v, size=(b, 1))
        tokens = (start + np.arange(l + 1)) % v
        batches.append(
            {
                "inputs": tokens[:, :-1].astype(np.int32),
                "targets": tokens[:, 1:].astype(np.int32),
                "weights": np.ones((b, l), np.float32),
            }
        )
    return batches


def unit_scale_params(model_cfg, seed: int) -> dict:
    """Random parameters at unit scale (kernels ~ N(0, 1/fan_in), norm scales ~ 1 + N(0, 1)
    / sqrt(d)): peaked predictions, unlike the near-uniform ones of a small init."""
    from jaxmoe.models.spec import abstract_params
    from jaxmoe.models.stack import unrolled_config

    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda a: (a.ndim == 1) + rng.standard_normal(a.shape, np.float32) / a.shape[0] ** 0.5,
        abstract_params(unrolled_config(model_cfg)),
    )


@contextlib.contextmanager
def compile_cache_off():
    """The persistent compilation cache (tests/conftest.py) off inside: jax writes the
    executables of compile-only TPU devices (topology compiles) into it but cannot load
    them back, and warns at each later compile of the same program."""
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # jax decides once whether to use the cache: again now
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()


def abstract_param_count(config) -> int:
    """Parameters of `config`'s model from its abstract shapes (eval_shape: nothing is
    allocated), on one device: the count does not depend on the mesh."""
    import math

    from jaxmoe.models.spec import model_spec
    from jaxmoe.parallel.mesh import make_mesh

    mesh = make_mesh(config.mesh.replace(expert=1), devices=jax.devices()[:1])
    spec = model_spec(config.model, mesh)
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(spec.abstract_params))
