"""`jaxmoe merge ADAPTERS --base BASE DST`: a LoRA checkpoint's adapters folded into its base
(W + alpha / r A B, in float32), written as an ordinary parameters-only checkpoint that
every command reads without a base (models/lora.py, training/lora_run.py)."""

import contextlib
import os
import shutil
from pathlib import Path

import jax

from jaxmoe.checkpoints.manager import save_params
from jaxmoe.checkpoints.staging import staged_directory
from jaxmoe.checkpoints.trees import flatten
from jaxmoe.errors import ConfigError
from jaxmoe.models.layers import LORA_A
from jaxmoe.models.lora import merged_params


def merge_lora(checkpoint: str, base: str, dst: str) -> dict:
    """Writes the merged model of LoRA checkpoint `checkpoint` on base checkpoint `base`
    (its fingerprint checked) to `dst`; returns {"merged": dst, "adapters": count}."""
    from jaxmoe.inference.trained_model import TrainedModel, checkpoint_config
    from jaxmoe.training.lora_run import lora_options

    # The base in float32 whatever the run kept in memory: the sum is made at full precision.
    overrides = [f"train.init_from={base}", "train.lora.base_dtype=float32"]
    config = checkpoint_config(checkpoint, overrides)
    lora = lora_options(config)
    if lora is None:
        raise ConfigError(f"checkpoint {checkpoint!r} holds no LoRA adapters (train.lora.rank=0)")
    model = TrainedModel.open(checkpoint, config=config, tokenizer=False)
    params = model.params
    adapters = sum(1 for path in flatten(params) if path[-1].endswith(LORA_A))
    with jax.set_mesh(model.mesh):
        merged = jax.jit(lambda tree: merged_params(tree, lora.scale))(params)
    merged = jax.device_get(merged)  # converted checkpoints are written from the host
    # A whole model now: no adapters, no base.
    train = config.train.replace(lora=config.train.lora.replace(rank=0), init_from="")
    stored = config.replace(train=train)
    with staged_directory(dst) as staging:
        save_params(str(staging), merged, stored)
    return {"merged": str(Path(dst).absolute()), "adapters": adapters}


@contextlib.contextmanager
def merged_copy(checkpoint: str, base: str, beside: str):
    """Yields the path of the merged model of `checkpoint` on `base`, written to a
    temporary folder next to `beside` and removed afterwards (`export hf --base`)."""
    folder = Path(beside).absolute().parent / f".{Path(beside).name}.merged-{os.getpid()}"
    try:
        merge_lora(checkpoint, base, str(folder))
        yield str(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
