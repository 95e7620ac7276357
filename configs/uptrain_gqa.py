"""Uptraining a converted checkpoint with its original recipe (the GQA paper's step 2).

After `jaxmoe convert gqa` (or `convert upcycle`) the model continues pre-training for
uptrain.alpha x the original run's steps (the paper: alpha = 0.05; GQA is usable at 0, MQA
needs it, returns diminish past 0.1). The variant is the converted checkpoint: its stored
config supplies the model and the original recipe (data, batch, sequence length,
optimizer, learning-rate schedule), `train.init_from` points at it, and the optimizer
state starts fresh. The warmup is shortened by the same factor alpha (at least one step),
so the schedule keeps its shape.

The whole sequence, from a multi-head model to a faster-decoding GQA one:
  jaxmoe train --config configs/default.py:dense --config.model.num_kv_heads=4 \\
      --workdir runs/mha
  jaxmoe convert gqa runs/mha runs/gqa2 --num_kv_heads 2 --method mean
  jaxmoe train --config configs/uptrain_gqa.py:runs/gqa2 --workdir runs/gqa2_up \\
      [--config.uptrain.alpha=0.1]
  jaxmoe eval --checkpoint runs/gqa2_up --data embedded
  jaxmoe decode --checkpoint runs/gqa2_up --prompt "The " --max_new_tokens 64

Without a variant the defaults of configs/default.py are the recipe; then set
--config.train.init_from=CKPT, --config.uptrain.original_steps=N and the model keys of CKPT.
train.steps and optimizer.warmup_steps are derived from uptrain.* in `finalize` (run after
the command-line overrides): change uptrain.alpha / uptrain.original_steps, not them.
"""

import math

from ml_collections import ConfigDict

from jaxmoe.default_config import base_config


def get_config(variant: str | None = None) -> ConfigDict:
    if variant:
        from jaxmoe.checkpoints.manager import read_config

        config = read_config(variant)  # the converted model and its original recipe
        stored = config.get("uptrain")
        original_steps = stored.original_steps if stored else config.train.steps
        original_warmup = stored.original_warmup_steps if stored else config.optimizer.warmup_steps
        config.train.init_from = variant
    else:
        config = base_config()
        original_steps, original_warmup = config.train.steps, config.optimizer.warmup_steps
    config.uptrain = u = ConfigDict()
    u.alpha = 0.05  # uptraining steps as a fraction of the original run's
    u.original_steps = int(original_steps)  # steps of the run the checkpoint came from
    u.original_warmup_steps = int(original_warmup)  # that run's warmup (scaled by alpha too)
    _derive_steps(config)  # again in finalize(), after command-line overrides
    return config


def finalize(config: ConfigDict) -> None:
    """Check the run and derive train.steps and the warmup (after command-line overrides)."""
    if not config.train.init_from:
        raise ValueError(
            "train.init_from is empty: uptraining starts from a converted checkpoint "
            "(configs/uptrain_gqa.py:CKPT or --config.train.init_from=CKPT)"
        )
    _derive_steps(config)


def _derive_steps(config: ConfigDict) -> None:
    u = config.uptrain
    if u.alpha <= 0:
        raise ValueError(f"uptrain.alpha={u.alpha} must be > 0 (alpha = 0 needs no training)")
    if u.original_steps < 1:
        raise ValueError(f"uptrain.original_steps={u.original_steps} must be >= 1")
    config.train.steps = max(1, round(u.alpha * u.original_steps))
    config.optimizer.warmup_steps = min(
        math.ceil(u.alpha * u.original_warmup_steps), config.train.steps
    )
