"""Config validation: impossible values and combinations, each a one-line ConfigError naming
the keys, before anything is compiled.

The option lists come from the modules that implement the options, so this module sits above
models/ in the dependency order (loading.py calls it; models never import it).
"""

from ml_collections import ConfigDict

from jaxmoe.data.curriculum import POLICIES as CURRICULUM_POLICIES
from jaxmoe.errors import ConfigError
from jaxmoe.models.attention import ROPE_TYPES
from jaxmoe.models.layers import ACTIVATIONS
from jaxmoe.models.moe.dispatch import DISPATCHES
from jaxmoe.models.moe.gates import BALANCE_FRACTIONS, GAP_NORMALIZATIONS, GATES, SINGLE_WEIGHTS
from jaxmoe.models.moe.layer import check_moe_config
from jaxmoe.models.stack import REMAT_POLICIES
from jaxmoe.training.optimizer import OPTIMIZERS, SCHEDULES
from jaxmoe.training.profiling import parse_profile_steps

# Each option list belongs to the module that implements the options.
CHOICES = {
    "model.arch": ("decoder", "encoder_decoder"),
    "model.activation": tuple(ACTIVATIONS),
    "model.rope_type": ROPE_TYPES,
    "model.dtype": ("float32", "bfloat16"),
    "model.remat": tuple(REMAT_POLICIES),
    "model.moe.gating": GATES,
    "model.moe.eval_gating": ("", *GATES),
    "model.moe.balance_fractions": BALANCE_FRACTIONS,
    "model.moe.gap_normalization": GAP_NORMALIZATIONS,
    "model.moe.single_weight": SINGLE_WEIGHTS,
    "model.moe.dispatch": DISPATCHES,
    "optimizer.name": OPTIMIZERS,
    "optimizer.schedule": SCHEDULES,
    "data.curriculum": CURRICULUM_POLICIES,
    "data.curriculum_source": ("previous_epoch", "scoring_pass"),
    "train.nonfinite": ("stop", "skip"),
}


def get(config: ConfigDict, key: str):
    node = config
    for part in key.split("."):
        node = node[part]
    return node


def validate(config: ConfigDict) -> None:
    """Impossible combinations, each as a one-line ConfigError naming keys and values."""
    from jaxmoe.models.stack import remat_name

    config.model.remat = remat_name(config.model.remat)  # true/false of older configs
    for key, allowed in CHOICES.items():
        value = get(config, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")
    m, moe, t = config.model, config.model.moe, config.train

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    for key in ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "ffn_dim"):
        need(m[key] > 0, f"model.{key}={m[key]} must be positive")
    need(
        m.num_heads % m.num_kv_heads == 0,
        f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}",
    )
    need(
        not m.rope_theta or m.head_dim % 2 == 0,
        f"model.head_dim={m.head_dim} must be even for rotary positions (model.rope_theta)",
    )
    if m.rope_type != "default":
        need(m.rope_theta > 0, f"model.rope_type={m.rope_type!r} needs model.rope_theta > 0")
        need(m.rope_factor > 0, f"model.rope_factor={m.rope_factor} must be positive")
    if m.rope_type == "llama3":
        need(
            0 < m.rope_low_freq_factor < m.rope_high_freq_factor,
            f"model.rope_low_freq_factor={m.rope_low_freq_factor} and model.rope_high_freq_"
            f"factor={m.rope_high_freq_factor} must satisfy 0 < low < high",
        )
        need(
            m.rope_original_max_len > 0,
            f"model.rope_original_max_len={m.rope_original_max_len} must be positive",
        )
    need(
        not m.qkv_bias or m.arch == "decoder",
        "model.qkv_bias=True is implemented for decoder models only (model.arch='decoder')",
    )
    need(
        m.attention_block >= -1,
        f"model.attention_block={m.attention_block} must be -1 (auto), 0 (dense) or a block size",
    )
    need(moe.num_experts >= 0, f"model.moe.num_experts={moe.num_experts} must be >= 0")
    if moe.num_experts:
        need(moe.every >= 1, f"model.moe.every={moe.every} must be >= 1")
        # Layer i is MoE when (i + 1) % every == 0: with every > the deepest stack no layer
        # is, and the run would silently train a dense model.
        depths = {"model.num_layers": m.num_layers}
        if m.arch == "encoder_decoder" and m.num_encoder_layers:
            depths["model.num_encoder_layers"] = m.num_encoder_layers
        need(
            moe.every <= max(depths.values()),
            f"model.moe.every={moe.every} exceeds "
            + " and ".join(f"{k}={v}" for k, v in depths.items())
            + ": no layer would be MoE (model.moe.num_experts=0 is the dense model)",
        )
        try:
            check_moe_config(m)  # the ranges of the MoE options live with the layer
        except ValueError as error:
            raise ConfigError(str(error)) from None
        expert_axis = config.mesh.expert
        need(
            expert_axis in (-1, 1) or moe.num_experts % expert_axis == 0,
            f"mesh.expert={expert_axis} does not divide model.moe.num_experts={moe.num_experts}",
        )
    for key in ("steps", "batch_size", "seq_len", "grad_accum", "log_every"):
        need(t[key] > 0, f"train.{key}={t[key]} must be positive")
    skipped = t.get("max_skipped_steps", 1)
    need(skipped > 0, f"train.max_skipped_steps={skipped} must be positive")
    need(
        t.batch_size % t.grad_accum == 0,
        f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}",
    )
    # 0 means "only at the end" / "the whole split" / "seed 0"; below 0 means nothing.
    for key in ("eval_every", "checkpoint_every", "eval_batches", "seed"):
        need(t[key] >= 0, f"train.{key}={t[key]} must be >= 0")
    need(t.max_to_keep >= 1, f"train.max_to_keep={t.max_to_keep} must be >= 1")
    need(t.peak_flops >= 0, f"train.peak_flops={t.peak_flops} must be >= 0")
    try:
        parse_profile_steps(t.profile_steps)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    need(
        config.optimizer.learning_rate > 0,
        f"optimizer.learning_rate={config.optimizer.learning_rate} must be positive",
    )
    need(
        config.optimizer.warmup_steps >= 0,
        f"optimizer.warmup_steps={config.optimizer.warmup_steps} must be >= 0",
    )
    o = config.optimizer
    for key in ("start_step", "schedule_steps"):
        need(o[key] >= 0, f"optimizer.{key}={o[key]} must be >= 0")
    need(0.0 < o.decay_rate <= 1.0, f"optimizer.decay_rate={o.decay_rate} not in (0, 1]")
    need(o.clipping_threshold >= 0, f"optimizer.clipping_threshold={o.clipping_threshold} < 0")
    need(0.0 <= o.momentum < 1.0, f"optimizer.momentum={o.momentum} not in [0, 1)")
    need(0.0 <= m.dropout_rate < 1.0, f"model.dropout_rate={m.dropout_rate} not in [0, 1)")
    need(t.logits_z_loss >= 0, f"train.logits_z_loss={t.logits_z_loss} must be >= 0")
    for axis in ("data", "fsdp", "tensor", "expert", "dcn_data", "dcn_fsdp"):
        size = config.mesh[axis]
        need(size == -1 or size >= 1, f"mesh.{axis}={size} must be positive or -1")
    for key in ("vocab_size", "max_len", "num_encoder_layers", "encoder_num_kv_heads"):
        need(m[key] >= 0, f"model.{key}={m[key]} must be >= 0 (0 = the default)")
    need(m.norm_eps > 0, f"model.norm_eps={m.norm_eps} must be positive")
    if m.arch == "encoder_decoder":
        for key in ("relpos_buckets", "relpos_max_distance"):
            need(m[key] > 0, f"model.{key}={m[key]} must be positive")
    for key in ("b1", "b2"):
        need(0.0 <= o[key] < 1.0, f"optimizer.{key}={o[key]} not in [0, 1)")
    for key in ("weight_decay", "grad_clip_norm", "eps"):
        need(o[key] >= 0, f"optimizer.{key}={o[key]} must be >= 0")
    need(0.0 <= o.min_lr_ratio <= 1.0, f"optimizer.min_lr_ratio={o.min_lr_ratio} not in [0, 1]")
    d = config.data
    need(
        d.vocab_size >= 260,
        f"data.vocab_size={d.vocab_size} < 260 (byte fallback)",
    )
    need(d.prefetch >= 0, f"data.prefetch={d.prefetch} must be >= 0 (0 = off)")
    need(d.prepare_timeout_s > 0, f"data.prepare_timeout_s={d.prepare_timeout_s} must be positive")


def resolve_vocab_size(config: ConfigDict, tokenizer_vocab: int) -> None:
    """model.vocab_size = 0 (a training config) takes the tokenizer's size, as training
    does; a smaller explicit size cannot embed the tokenizer's ids."""
    with config.unlocked():
        if config.model.vocab_size == 0:
            config.model.vocab_size = tokenizer_vocab
    if config.model.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer_vocab})"
        )
