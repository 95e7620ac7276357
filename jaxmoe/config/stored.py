"""A config stored with a checkpoint (JSON), completed to today's schema.

A checkpoint written by older code lacks the keys added since: they take their defaults,
so every config that reaches code has every key. A stored key no schema knows (one since
removed or renamed) is dropped, with one warning line naming them all: refusing it would
make every checkpoint of older code unreadable for a key nothing reads any more. Top-level
sections outside the schema (a config file's EXTRA_KEYS, a converter's `source`) are kept
as stored.
"""

import logging

from ml_collections import ConfigDict

from jaxmoe.config.defaults import base_config
from jaxmoe.config.schema import SECTIONS, key_type
from jaxmoe.errors import ConfigError

log = logging.getLogger(__name__)
_warned: set[tuple[str, tuple[str, ...]]] = set()


def complete_stored(stored: dict, origin: str = "stored config") -> ConfigDict:
    """`stored` on top of base_config(); `origin` names it in the warning and errors."""
    config, dropped = base_config(), []
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
