"""Config files and command-line overrides.

A config is a Python file with `get_config(variant: str | None) -> ConfigDict`, named as
`path/to/file.py[:variant]`. Overrides are `--config.a.b=value`. Every problem becomes a
one-line ConfigError naming the key, before anything is compiled.
"""

import ast
import difflib
import importlib.util
from pathlib import Path

from ml_collections import ConfigDict

from jaxmoe.config.validation import validate
from jaxmoe.errors import ConfigError
from jaxmoe.storage.paths import absolute_config_paths, absolute_path


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
