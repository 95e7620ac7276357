"""A config stored with a checkpoint (JSON), completed to today's schema.

A checkpoint written by older code lacks the keys added since: they take their defaults,
so every config that reaches code has every key. A stored key no schema knows (one since
removed or renamed) is dropped, with one warning line naming them all: refusing it would
make every checkpoint of older code unreadable for a key nothing reads any more. Top-level
sections outside the schema (a config file's EXTRA_KEYS, a converter's `source`) are kept
as stored.

`read_config(checkpoint)` is a checkpoint's config as a JobConfig; `opened_config` is the
one a command opens a checkpoint with (the stored places reset, the command line's
overrides applied); `stored_config_dict` is for config files, which build ConfigDicts.
"""

import logging

from ml_collections import ConfigDict

from jaxmoe.checkpoints.manager import read_stored_config, stored_config_origin
from jaxmoe.config.defaults import base_config
from jaxmoe.config.loading import apply_overrides
from jaxmoe.config.schema import SECTIONS, JobConfig, key_type
from jaxmoe.config.validation import validate
from jaxmoe.errors import ConfigError

# Stored keys that name places to read or write: the sender's, not the reader's. A
# checkpoint is data, never instructions: a command opening one resets them.
STORED_PLACES = ("data.source", "data.mixture", "data.cache_dir", "data.data_dir",
                 "train.init_from")  # fmt: skip

log = logging.getLogger(__name__)
_warned: set[tuple[str, tuple[str, ...]]] = set()


def read_config(checkpoint: str, *, tokenizer: bool = True) -> JobConfig:
    """The config stored with `checkpoint`, completed and typed; its `data.tokenizer`
    resolved inside the checkpoint (`tokenizer=False`: as stored)."""
    return validate(stored_config_dict(checkpoint, tokenizer=tokenizer))


def stored_config_dict(checkpoint: str, *, tokenizer: bool = True) -> ConfigDict:
    """`read_config`'s values as a ConfigDict, for a config file that starts from a
    checkpoint's recipe (configs/uptrain_gqa.py)."""
    stored = read_stored_config(checkpoint, tokenizer=tokenizer)
    return complete_stored(stored, stored_config_origin(checkpoint))


def opened_config(checkpoint: str, overrides=(), *, tokenizer: bool = True) -> JobConfig:
    """The config a command opens `checkpoint` with: the stored one, its places reset to
    the defaults (STORED_PLACES), then the `--config.KEY=VALUE` overrides applied."""
    config = stored_config_dict(checkpoint, tokenizer=tokenizer)
    defaults = base_config()
    for key in STORED_PLACES:
        section, leaf = key.split(".")
        config[section][leaf] = defaults[section][leaf]
    apply_overrides(config, overrides)
    return validate(config)


def inherit_tokenizer(config: JobConfig) -> JobConfig:
    """Training from a checkpoint (`train.init_from`) with no `data.tokenizer` of its own
    takes the checkpoint's (a converted model's copied files): its ids are the ones that
    model's embeddings were trained on. The train and prepare commands call this before
    the data is opened, so later checkpoints record it."""
    init_from = config.train.init_from
    if config.data.tokenizer or not init_from:
        return config
    inherited = read_config(init_from).data.tokenizer
    if not inherited:
        return config
    log.info("data.tokenizer=%s, from train.init_from", inherited)
    return config.replace(data=config.data.replace(tokenizer=inherited))


def complete_stored(stored: dict, origin: str = "stored config") -> ConfigDict:
    """`stored` on top of base_config(); `origin` names it in the warning and errors."""
    config, dropped = base_config(), list[str]()
    with config.unlocked():
        for name, value in stored.items():
            if name in SECTIONS:
                _merge(config, name, value, name, origin, dropped)
            else:
                config[name] = value
    if dropped and (origin, tuple(dropped)) not in _warned:  # a command reads it more than once
        _warned.add((origin, tuple(dropped)))
        log.warning("%s: ignoring keys no jaxmoe config has: %s", origin, ", ".join(dropped))
    return config


def _merge(parent: ConfigDict, name: str, value, key: str, origin: str, dropped: list) -> None:
    """`parent[name] = value` for the stored `key`, into sections recursively, as the
    schema's type; a key it does not know goes on `dropped`."""
    from jaxmoe.models.stack import remat_name

    if name in parent and isinstance(parent[name], ConfigDict):
        if not isinstance(value, dict):
            raise ConfigError(f"{origin}: {key}={value!r}: expected a section of keys")
        for child, child_value in value.items():
            _merge(parent[name], child, child_value, f"{key}.{child}", origin, dropped)
        return
    kind = key_type(key)
    if kind is None:
        dropped.append(key)
        return
    if key == "model.remat":
        value = remat_name(value)  # a bool before remat took a policy name
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not kind:
        raise ConfigError(
            f"{origin}: {key}={value!r}: expected {kind.__name__}, got {type(value).__name__}"
        )
    parent[name] = value
