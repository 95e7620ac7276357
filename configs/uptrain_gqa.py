"""Uptraining a converted checkpoint with its original recipe (the GQA paper's step 2).

After `jaxmoe convert gqa` (or `convert upcycle`) the model continues pre-training for
uptrain.alpha x the original run's steps (the paper: alpha = 0.05; GQA is usable at 0, MQA
needs it, returns diminish past 0.1). The variant is the converted checkpoint: its stored
config supplies the model and the original recipe (data, batch, sequence length,
optimizer, learning-rate schedule), `train.init_from` points at it, and the optimizer
state starts fresh, unless the checkpoint carries one and its config says
`train.init_optimizer` (`jaxmoe convert t5x --keep_optimizer`): then T5X's Adafactor moments
continue exactly. `convert gqa` keeps no optimizer state, so a pooled model starts all of
it fresh: the pooled K/V kernels change shape and gradient statistics, and a fresh moment at
T5X's late decay (1 - N^-0.8, near 1) would give those kernels clipped, sign-like steps for
thousands of steps; a fresh state restarts the decay for every kernel alike (T5X's
`step_offset`).

The schedule is not restarted: it continues at the step where the source stopped
(optimizer.start_step = uptrain.original_steps), past the warmup, and a cosine keeps its
original length, so after its end it stays at its floor. The source's step count is its
config's start_step + train.steps (a jaxmoe run), or the step `jaxmoe convert t5x` recorded
in `source.step` (T5X checkpoints carry T5.1.1's recipe: 1/sqrt(max(N, 10k)) at step N).

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
train.steps, optimizer.start_step and optimizer.schedule_steps are derived from uptrain.* in
`finalize` (run after the command-line overrides): change uptrain.*, not them (setting one of
them on the command line is refused, naming the uptrain.* key to set instead).
"""

from ml_collections import ConfigDict

from jaxmoe.config.defaults import base_config

EXTRA_KEYS = ("uptrain",)  # this file's own section, beside base_config()'s keys
# Each key finalize derives, and the uptrain.* key to set instead.
DERIVED = {
    "train.steps": "uptrain.alpha",
    "optimizer.start_step": "uptrain.original_steps",
    "optimizer.schedule_steps": "uptrain.original_schedule_steps",
}


def source_schedule(config: ConfigDict) -> tuple[int, int]:
    """(step the checkpoint's run stopped at, length of its schedule) from its config."""
    source = config.get("source")
    if source is not None and not config.train.init_from:  # converted from elsewhere
        return source.step, source.step
    o = config.optimizer
    stopped = o.start_step + config.train.steps
    return stopped, o.schedule_steps or stopped


def get_config(variant: str | None = None) -> ConfigDict:
    if variant:
        from jaxmoe.config.stored import stored_config_dict

        config = stored_config_dict(variant)  # the converted model and its original recipe
        original_steps, schedule_steps = source_schedule(config)
        if "source" in config:
            del config["source"]  # describes the checkpoint, not this run
        config.train.init_from = variant
    else:
        config = base_config()
        original_steps = schedule_steps = config.train.steps
    config.uptrain = u = ConfigDict()
    u.alpha = 0.05  # uptraining steps as a fraction of the original run's
    u.original_steps = original_steps  # steps of the source run: the schedule resumes here
    u.original_schedule_steps = schedule_steps  # length of the source run's schedule
    return config


def finalize(config: ConfigDict, overridden=frozenset()) -> None:
    """Check the run and derive train.steps and the schedule (after command-line overrides;
    `overridden`: the keys set there, none of which may be one this derives)."""
    for key, source in DERIVED.items():
        if key in overridden:
            raise ValueError(
                f"--config.{key} conflicts with {source}: configs/uptrain_gqa.py derives "
                f"{key} from uptrain.* (set --config.{source} instead)"
            )
    if not config.train.init_from:
        raise ValueError(
            "train.init_from is empty: uptraining starts from a converted checkpoint "
            "(configs/uptrain_gqa.py:CKPT or --config.train.init_from=CKPT)"
        )
    u = config.uptrain
    if u.alpha <= 0:
        raise ValueError(f"uptrain.alpha={u.alpha} must be > 0 (alpha = 0 needs no training)")
    if u.original_steps < 1:
        raise ValueError(
            f"uptrain.original_steps={u.original_steps} must be >= 1 (the source's training "
            "steps; a step-0 checkpoint has none: set --config.uptrain.original_steps)"
        )
    config.train.steps = max(1, round(u.alpha * u.original_steps))
    config.optimizer.start_step = u.original_steps
    config.optimizer.schedule_steps = max(u.original_schedule_steps, u.original_steps)
