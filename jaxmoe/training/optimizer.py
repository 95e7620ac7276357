"""Optimizer and learning-rate schedule from `config.optimizer` (optax)."""

import jax
import jax.numpy as jnp
import optax

from jaxmoe.training.adafactor import t5x_adafactor

OPTIMIZERS = ("adamw", "adafactor", "t5x_adafactor", "muon")  # optimizer.name
SCHEDULES = ("cosine", "rsqrt", "constant", "t5x_rsqrt")  # optimizer.schedule


def _schedule_from_zero(opt_cfg, horizon: int) -> optax.Schedule:
    """The schedule as a function of the step counted from the start of the recipe."""
    peak, warmup = opt_cfg.learning_rate, opt_cfg.warmup_steps
    if opt_cfg.schedule == "t5x_rsqrt":
        # T5X's rsqrt_decay: learning_rate / sqrt(max(step, warmup)), flat during the warmup
        # (T5.1.1: 1.0 / sqrt(max(step, 10_000))).
        floor = float(max(warmup, 1))
        return lambda count: peak / jnp.sqrt(jnp.maximum(jnp.asarray(count, jnp.float32), floor))
    warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
    if opt_cfg.schedule == "cosine":
        decay_steps = max(horizon - warmup, 1)
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=opt_cfg.min_lr_ratio)
    elif opt_cfg.schedule == "rsqrt":
        # Linear warmup to the peak, then peak * sqrt(warmup / step).
        scale = max(warmup, 1) ** 0.5
        after = lambda count: peak * scale / jnp.sqrt(count + max(warmup, 1))
    else:
        after = optax.constant_schedule(peak)
    if warmup == 0:
        return after
    return optax.join_schedules([warm, after], [warmup])


def learning_rate_schedule(opt_cfg, total_steps: int) -> optax.Schedule:
    """The learning rate at this run's step `count`, which is step start_step + count of
    the recipe: uptraining continues a schedule where its source stopped. Cosine decays over
    schedule_steps (0: start_step + total_steps, i.e. to the end of this run)."""
    start = opt_cfg.start_step
    horizon = opt_cfg.schedule_steps or start + total_steps
    schedule = _schedule_from_zero(opt_cfg, horizon)
    if not start:
        return schedule
    return lambda count: schedule(count + start)


def _decay_mask(params):
    # Norm scales and other vectors are not decayed: shrinking them only fights the norm.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _adamw(opt_cfg, schedule) -> optax.GradientTransformation:
    return optax.adamw(
        schedule,
        b1=opt_cfg.b1,
        b2=opt_cfg.b2,
        eps=opt_cfg.eps,
        weight_decay=opt_cfg.weight_decay,
        mask=_decay_mask,
    )


def make_optimizer(
    opt_cfg, total_steps: int, param_axes=None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(the `optimizer` section's update rule, its schedule). `param_axes` (models/spec.py
    ModelSpec.param_axes) tells Muon which parameters are matrices; the others need none."""
    schedule = learning_rate_schedule(opt_cfg, total_steps)
    chain = []
    if opt_cfg.grad_clip_norm:
        chain.append(optax.clip_by_global_norm(opt_cfg.grad_clip_norm))
    if opt_cfg.name == "adamw":
        chain.append(_adamw(opt_cfg, schedule))
    elif opt_cfg.name == "muon":
        from jaxmoe.training.muon import muon

        chain.append(muon(opt_cfg, schedule, param_axes, _adamw(opt_cfg, schedule)))
    elif opt_cfg.name == "t5x_adafactor":
        chain.append(
            t5x_adafactor(
                schedule,
                decay_rate=opt_cfg.decay_rate,
                clipping_threshold=opt_cfg.clipping_threshold or None,
                momentum=opt_cfg.momentum or None,
            )
        )
    else:
        chain.append(optax.adafactor(schedule, multiply_by_parameter_scale=False))
    return optax.chain(*chain), schedule
