"""Optimizer and learning-rate schedule from `config.optimizer` (optax)."""

import jax
import jax.numpy as jnp
import optax


def learning_rate_schedule(opt_cfg, total_steps: int) -> optax.Schedule:
    """Linear warmup, then cosine decay to min_lr_ratio * peak, rsqrt decay, or constant."""
    peak, warmup = opt_cfg.learning_rate, opt_cfg.warmup_steps
    warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
    if opt_cfg.schedule == "cosine":
        decay_steps = max(total_steps - warmup, 1)
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=opt_cfg.min_lr_ratio)
    elif opt_cfg.schedule == "rsqrt":
        # T5's schedule: peak * sqrt(warmup / step) after warmup.
        scale = max(warmup, 1) ** 0.5
        after = lambda count: peak * scale / jnp.sqrt(count + max(warmup, 1))
    else:
        after = optax.constant_schedule(peak)
    if warmup == 0:
        return after
    return optax.join_schedules([warm, after], [warmup])


def _decay_mask(params):
    # Norm scales and other vectors are not decayed: shrinking them only fights the norm.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(
    opt_cfg, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = learning_rate_schedule(opt_cfg, total_steps)
    chain = []
    if opt_cfg.grad_clip_norm:
        chain.append(optax.clip_by_global_norm(opt_cfg.grad_clip_norm))
    if opt_cfg.name == "adamw":
        chain.append(
            optax.adamw(
                schedule,
                b1=opt_cfg.b1,
                b2=opt_cfg.b2,
                eps=opt_cfg.eps,
                weight_decay=opt_cfg.weight_decay,
                mask=_decay_mask,
            )
        )
    else:
        chain.append(optax.adafactor(schedule, multiply_by_parameter_scale=False))
    return optax.chain(*chain), schedule
