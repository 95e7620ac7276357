"""Config files, command-line overrides and validation.

A config is a Python file with `get_config(variant: str | None) -> ConfigDict`, named as
`path/to/file.py[:variant]`. Overrides are `--config.a.b=value`. Every problem becomes a
one-line ConfigError naming the key, before anything is compiled.
"""

import ast
import difflib
import importlib.util
from pathlib import Path

from ml_collections import ConfigDict

from jaxmoe.models.attention import ROPE_TYPES
from jaxmoe.models.gates import BALANCE_FRACTIONS
from jaxmoe.parallel.sharding import ConfigError
from jaxmoe.paths import absolute_config_paths, absolute_path
from jaxmoe.profiling import parse_profile_steps

GATES = ("top1", "top2", "topk", "adaptive", "top_p")
CHOICES = {
    "model.arch": ("decoder", "encoder_decoder"),
    "model.activation": ("silu", "gelu", "relu"),
    "model.rope_type": ROPE_TYPES,
    "model.dtype": ("float32", "bfloat16"),
    "model.remat": ("none", "full", "dots_saveable", "offload_dots"),
    "model.moe.gating": GATES,
    "model.moe.eval_gating": ("", *GATES),
    "model.moe.balance_fractions": BALANCE_FRACTIONS,
    "model.moe.gap_normalization": ("top2", "none"),
    "model.moe.single_weight": ("prob", "one"),
    "model.moe.dispatch": ("auto", "blocks", "ragged", "dense", "capacity"),
    "optimizer.name": ("adamw", "adafactor", "t5x_adafactor"),
    "optimizer.schedule": ("cosine", "rsqrt", "constant", "t5x_rsqrt"),
    "data.curriculum": ("none", "paper", "magnitude"),
    "data.curriculum_source": ("previous_epoch", "scoring_pass"),
    "train.nonfinite": ("stop", "skip"),
}


def load_config(spec: str, overrides: list[str] | tuple[str, ...] = ()) -> ConfigDict:
    """Load `file.py[:variant]`, apply `key=value` overrides, validate, return it."""
    path_text, _, variant = spec.partition(":")
    path = Path(absolute_path(path_text))
    if not path.is_file():
        raise ConfigError(f"--config: no such config file {path_text!r}")
    module_spec = importlib.util.spec_from_file_location(f"jaxmoe_config_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # a config file is user code: report where it broke
        raise ConfigError(f"--config: {path_text} failed to load: {error}") from error
    if not hasattr(module, "get_config"):
        raise ConfigError(f"--config: {path_text} defines no get_config()")
    try:
        config = module.get_config(variant or None)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    apply_overrides(config, overrides)
    finalize = getattr(module, "finalize", None)  # derived keys, computed after the overrides
    if finalize is not None:
        try:
            finalize(config)
        except ValueError as error:
            raise ConfigError(str(error)) from error
    validate(config)
    return config


def _leaf_keys(config: ConfigDict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in config.items():
        if isinstance(value, ConfigDict):
            keys += _leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.append(prefix + key)
    return keys


def _parse(key: str, text: str, current):
    """Parse `text` as the type of the current value."""
    if isinstance(current, bool):
        lowered = text.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ConfigError(f"--config.{key}={text}: expected a bool (true/false)")
    if isinstance(current, str):
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(
            f"--config.{key}={text}: expected {type(current).__name__}, got {text!r}"
        ) from None
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not type(current):
        raise ConfigError(
            f"--config.{key}={text}: expected {type(current).__name__}, got {type(value).__name__}"
        )
    return value


def apply_overrides(config: ConfigDict, overrides) -> None:
    """Apply `a.b=value` (or `--config.a.b=value`) strings in place."""
    known = _leaf_keys(config)
    for item in overrides:
        text = item.removeprefix("--").removeprefix("config.")
        if "=" not in text:
            raise ConfigError(f"override {item!r}: expected --config.KEY=VALUE")
        key, value_text = text.split("=", 1)
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}")
        *parents, leaf = key.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[leaf] = _parse(key, value_text, node[leaf])
    absolute_config_paths(config)


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
        need(moe.ffn_dim > 0, f"model.moe.ffn_dim={moe.ffn_dim} must be positive")
        need(0.0 <= moe.threshold <= 1.0, f"model.moe.threshold={moe.threshold} not in [0, 1]")
        need(0.0 < moe.top_p <= 1.0, f"model.moe.top_p={moe.top_p} not in (0, 1]")
        need(
            1 <= moe.top_k <= moe.num_experts,
            f"model.moe.top_k={moe.top_k} not in [1, model.moe.num_experts={moe.num_experts}]",
        )
        need(
            1 <= moe.max_k <= moe.num_experts,
            f"model.moe.max_k={moe.max_k} not in [1, model.moe.num_experts={moe.num_experts}]",
        )
        need(
            moe.num_experts >= 2 or moe.gating == "top1",
            f"model.moe.gating={moe.gating!r} needs model.moe.num_experts >= 2",
        )
        need(moe.capacity_factor >= 0, f"model.moe.capacity_factor={moe.capacity_factor} < 0")
        need(moe.block_size > 0, f"model.moe.block_size={moe.block_size} must be positive")
        need(
            moe.ep_buffer_factor > 0,
            f"model.moe.ep_buffer_factor={moe.ep_buffer_factor} must be positive",
        )
        need(
            moe.ep_exchange in ("auto", "ragged", "padded"),
            f"model.moe.ep_exchange={moe.ep_exchange!r} not in auto | ragged | padded",
        )
        expert_axis = config.mesh.expert
        need(
            expert_axis in (-1, 1) or moe.num_experts % expert_axis == 0,
            f"mesh.expert={expert_axis} does not divide model.moe.num_experts={moe.num_experts}",
        )
    for key in ("steps", "batch_size", "seq_len", "grad_accum", "log_every"):
        need(t[key] > 0, f"train.{key}={t[key]} must be positive")
    need(
        t.batch_size % t.grad_accum == 0,
        f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}",
    )
    for key in ("eval_every", "checkpoint_every", "eval_batches"):
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
    need(
        config.data.vocab_size >= 260,
        f"data.vocab_size={config.data.vocab_size} < 260 (byte fallback)",
    )


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
