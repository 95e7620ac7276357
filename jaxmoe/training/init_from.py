"""Fine-tuning from a checkpoint (`train.init_from`): the model comes from the checkpoint.

`jaxmoe train --workdir RUN --config.train.init_from=CKPT` with no `--config` starts from
CKPT's stored config: its model section, its tokenizer and its data format keys
(INHERITED_DATA_KEYS: how its examples were read, so a fine-tuned checkpoint fine-tunes on
the same kind of data), with the train, optimizer and mesh sections at their defaults; the
command line overrides any of them. With a `--config` file the file's train, data and
optimizer keys apply, and its model section must agree with the checkpoint: a model key the
file or the command line sets to another value than CKPT's is refused in one line, except
the keys a run may choose for itself (RUN_MODEL_KEYS: how the model computes, routes and is
regularised, never what its parameters are). A model key left at its default takes CKPT's.
"""

from collections.abc import Collection

from jaxmoe.config.loading import with_overrides
from jaxmoe.config.schema import JobConfig, leaf_fields, typed
from jaxmoe.config.stored import read_config
from jaxmoe.config.validation import get
from jaxmoe.data.options import FORMAT_KEYS
from jaxmoe.errors import ConfigError

INHERITED_DATA_KEYS = ("tokenizer", "eos_token", *FORMAT_KEYS)
# Model keys a fine-tuning run may set apart from its checkpoint (the adaptive-gating paper
# fine-tunes a top-2 checkpoint with another gate): none changes a parameter.
RUN_MODEL_KEYS = frozenset(
    f"model.{key}"
    for key in (
        "dtype", "quantization", "quantization_scaling", "attention_block", "attention_kernel",
        "remat", "scan_layers", "dropout_rate",
        "max_len", "moe.gating", "moe.threshold", "moe.top_k", "moe.top_p", "moe.max_k",
        "moe.eval_gating", "moe.gap_normalization", "moe.renormalize", "moe.single_weight",
        "moe.capacity_factor", "moe.balance_loss_weight", "moe.balance_fractions",
        "moe.z_loss_weight", "moe.expert_dropout_rate", "moe.jitter", "moe.block_size",
        "moe.dispatch", "moe.ep_exchange", "moe.ep_buffer_factor", "moe.bias_update_rate",
        "moe.sequence_balance_weight", "moe.replay",
    )
)  # fmt: skip


def _key(override: str) -> str:
    return override.removeprefix("--").removeprefix("config.").partition("=")[0]


def overridden_keys(overrides) -> set[str]:
    """The keys `--config.KEY=VALUE` overrides set."""
    return {_key(item) for item in overrides}


DEFAULT_CONFIG = "configs/default.py"


def run_config(config_file: str | None, overrides) -> JobConfig:
    """The config `jaxmoe train` and `jaxmoe prepare` run: `config_file` (default
    configs/default.py) with the overrides and, with train.init_from, the checkpoint's
    model; with no file and train.init_from, the checkpoint's config (config_from_checkpoint)."""
    from jaxmoe.config.loading import load_config

    if config_file is None and "train.init_from" in overridden_keys(overrides):
        return config_from_checkpoint(overrides)
    config = load_config(config_file or DEFAULT_CONFIG, overrides)
    return adopt_checkpoint_model(config, overridden_keys(overrides))


def config_from_checkpoint(overrides) -> JobConfig:
    """The config of `jaxmoe train` without --config: train.init_from's checkpoint's model,
    tokenizer and data format (see the module doc), defaults elsewhere, then `overrides`."""
    model_overrides = [o for o in overrides if _key(o).startswith("model.")]
    others = [o for o in overrides if o not in model_overrides]
    config = with_overrides(JobConfig(), others)  # paths made absolute, types checked
    stored = _stored(config.train.init_from)
    explicit = overridden_keys(overrides)
    inherited = {
        key: getattr(stored.data, key)
        for key in INHERITED_DATA_KEYS
        if f"data.{key}" not in explicit
    }
    config = config.replace(model=stored.model, data=config.data.replace(**inherited))
    # The model keys the command line sets, on the checkpoint's model: a run may change
    # RUN_MODEL_KEYS; any other is refused by adopt_checkpoint_model.
    return adopt_checkpoint_model(with_overrides(config, model_overrides), explicit, stored)


def adopt_checkpoint_model(
    config: JobConfig, explicit: Collection[str] = (), stored: JobConfig | None = None
) -> JobConfig:
    """`config` with its model made the checkpoint's (train.init_from): keys that agree or
    are left at their defaults take the checkpoint's values; RUN_MODEL_KEYS the config sets
    (in `explicit`, or to a value other than the default) keep the config's; any other
    disagreement is a one-line ConfigError naming the key and both values."""
    if not config.train.init_from:
        return config
    stored = stored if stored is not None else _stored(config.train.init_from)
    # Compared key by key as nested plain dicts; the result typed and checked once.
    values, theirs_all, defaults = config.to_dict(), stored.to_dict(), JobConfig().to_dict()
    for key in (k for k in leaf_fields() if k.startswith("model.")):
        mine, theirs = get(values, key), get(theirs_all, key)
        if mine == theirs:
            continue
        chosen = key in explicit or mine != get(defaults, key)
        if not chosen:
            _set(values, key, theirs)
        elif key not in RUN_MODEL_KEYS:
            raise ConfigError(
                f"{key}={mine!r} disagrees with train.init_from's checkpoint ({theirs!r}): "
                f"a fine-tuning run takes its model from the checkpoint (leave {key} out, "
                f"or leave out --config to take the checkpoint's config)"
            )
    return typed(values)


def _stored(init_from: str) -> JobConfig:
    """The checkpoint's config, completed and checked."""
    try:
        return read_config(init_from)
    except Exception as error:  # a missing or unreadable checkpoint: one line naming it
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"train.init_from={init_from!r}: {first}") from None


def _set(values: dict, key: str, value) -> None:
    """`values` (nested plain dicts) with `key` ("model.moe.top_k") set to `value`."""
    *parents, leaf = key.split(".")
    node = values
    for part in parents:
        node = node[part]
    node[leaf] = value
