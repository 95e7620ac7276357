"""Config files and command-line overrides.

A config is a Python file with `get_config(variant: str | None) -> ConfigDict`, named as
`path/to/file.py[:variant]`. Overrides are `--config.a.b=value`. Every problem becomes a
one-line ConfigError naming the key (and the file), before anything is compiled.

A file sets only keys of `base_config()`, as the command line does, except under the
prefixes it names in `EXTRA_KEYS` (its own top-level section, e.g. configs/uptrain_gqa.py's
`uptrain`; inside the schema's sections every key is the schema's). Keys it leaves out take
their defaults. An optional `finalize(config, overridden)` derives keys after the overrides;
`overridden` holds the keys set on the command line, which it must not replace.

ConfigDict lives here, for config files, overrides and `finalize`; what leaves is the typed
`JobConfig` (schema.py), and `with_overrides` derives one with `--config.KEY=VALUE` set.
"""

import ast
import importlib.machinery
import importlib.util
from pathlib import Path

from ml_collections import ConfigDict

from jaxmoe.config.defaults import base_config, complete
from jaxmoe.config.schema import JobConfig, key_type, unknown_key_message
from jaxmoe.config.validation import get, validate
from jaxmoe.errors import ConfigError
from jaxmoe.storage.paths import absolute_data_spec, absolute_mixture, absolute_path

# Config keys holding one path each ("" keeps the key's default).
PATH_KEYS = ("train.init_from", "data.tokenizer", "data.cache_dir", "data.data_dir")
# Config keys holding a path or one of these names (data.chat_template: chat_template.py).
PATH_OR_NAME_KEYS = {"data.chat_template": ("chatml",)}


def load_config(spec: str, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Load `file.py[:variant]`, apply `key=value` overrides; the typed, checked config."""
    path_text, _, variant = spec.partition(":")
    path = Path(absolute_path(path_text))
    if not path.is_file():
        raise ConfigError(f"--config: no such config file {path_text!r}")
    module = _import(path, path_text)
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise ConfigError(f"--config: {path_text} defines no get_config()")
    config = _call(path_text, f"get_config({variant or None!r})", get_config, variant or None)
    if not isinstance(config, ConfigDict):
        raise ConfigError(
            f"--config: {path_text}: get_config() returned a {type(config).__name__}, "
            "not an ml_collections ConfigDict"
        )
    extra = tuple(getattr(module, "EXTRA_KEYS", ()))
    _check_keys(config, path_text, extra)
    complete(config)  # the keys a file leaves out take their defaults, so code finds them all
    overridden = apply_overrides(config, overrides)
    finalize = getattr(module, "finalize", None)  # derived keys, computed after the overrides
    if finalize is not None:
        given = {key: get(config, key) for key in overridden}
        _call(path_text, "finalize()", finalize, config, frozenset(overridden))
        _check_keys(config, path_text, extra)
        for key, value in given.items():
            if get(config, key) != value:
                raise ConfigError(
                    f"--config.{key}={value}: {path_text}'s finalize() derives {key} "
                    f"(it would set {get(config, key)!r}); set what it derives it from"
                )
    return validate(config)


def with_overrides(config: JobConfig, overrides) -> JobConfig:
    """`config` with `key=value` (or `--config.key=value`) overrides applied, checked."""
    if not overrides:
        return config
    values = ConfigDict(config.to_dict())
    apply_overrides(values, overrides)
    return validate(values)


def _import(path: Path, path_text: str):
    """The config file as a module; any failure is one line naming the file."""
    name = f"jaxmoe_config_{path.stem}"
    # An explicit source loader: a config named .yaml or .txt is read as Python, not skipped.
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.machinery.ModuleSpec(name, loader, origin=str(path))
    spec.has_location = True  # the module's __file__ is the config file
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except SyntaxError as error:
        raise ConfigError(
            f"--config: {path_text} is not a Python config file (line {error.lineno}: "
            f"{error.msg}); a config defines get_config() returning a ConfigDict"
        ) from None
    except Exception as error:  # a config file is user code: report where it broke
        raise ConfigError(f"--config: {path_text} failed to load: {_describe(error)}") from error
    return module


def _call(path_text: str, what: str, function, *args):
    """`function(*args)` from a config file; any exception is one line naming the file."""
    try:
        return function(*args)
    except ValueError as error:  # the file's own message (an unknown variant, a bad key)
        message = _describe(error, with_type=False)
        if Path(path_text).name not in message:
            message = f"{path_text}: {message}"
        raise ConfigError(message) from error
    except Exception as error:
        raise ConfigError(f"--config: {path_text}: {what} failed: {_describe(error)}") from error


def _describe(error: Exception, with_type: bool = True) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if not with_type:
        return text or type(error).__name__
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _check_keys(config: ConfigDict, path_text: str, extra: tuple[str, ...]) -> None:
    """Every key the file set is one of base_config()'s or under one of its EXTRA_KEYS."""
    known = _leaf_keys(base_config())
    known_set = set(known)
    for key in _leaf_keys(config):
        if key in known_set or any(key == p or key.startswith(p + ".") for p in extra):
            continue
        raise ConfigError(f"{path_text}: {unknown_key_message(key, known)}")


def _leaf_keys(config: ConfigDict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in config.items():
        if isinstance(value, ConfigDict):
            keys += _leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.append(prefix + key)
    return keys


def _parse(key: str, text: str, current):
    """Parse `text` as the schema's type of `key` (a config file's own key: as the type of
    its current value)."""
    kind = key_type(key) or type(current)
    if kind is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ConfigError(f"--config.{key}={text}: expected a bool (true/false)")
    if kind is str:
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(
            f"--config.{key}={text}: expected {kind.__name__}, got {text!r}"
        ) from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not kind:
        raise ConfigError(
            f"--config.{key}={text}: expected {kind.__name__}, got {type(value).__name__}"
        )
    return value


def _split_override(item: str) -> tuple[str, str]:
    """`a.b=value` (or `--config.a.b=value`) -> ("a.b", "value")."""
    text = item.removeprefix("--").removeprefix("config.")
    if "=" not in text:
        raise ConfigError(f"override {item!r}: expected --config.KEY=VALUE")
    key, value_text = text.split("=", 1)
    return key, value_text


def override_keys(overrides) -> list[str]:
    """The keys `key=value` overrides set, in order."""
    return [_split_override(item)[0] for item in overrides]


def apply_overrides(config: ConfigDict, overrides) -> list[str]:
    """Apply `a.b=value` (or `--config.a.b=value`) strings in place; returns the keys set."""
    known = _leaf_keys(config)
    keys = []
    for item in overrides:
        key, value_text = _split_override(item)
        if key not in known:
            raise ConfigError(unknown_key_message(key, known))
        *parents, leaf = key.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[leaf] = _parse(key, value_text, node[leaf])
        keys.append(key)
    _absolute_paths(config)
    return keys


def _absolute_paths(config: ConfigDict) -> None:
    """Every path-valued key made absolute, in place: where paths a user typed enter."""
    with config.unlocked():
        for key in PATH_KEYS:
            section, leaf = key.split(".")
            if section in config and leaf in config[section]:
                config[section][leaf] = absolute_path(config[section][leaf])
        for key, names in PATH_OR_NAME_KEYS.items():
            section, leaf = key.split(".")
            present = section in config and leaf in config[section]
            if present and config[section][leaf] not in names:
                config[section][leaf] = absolute_path(config[section][leaf])
        if "data" in config and "source" in config.data:
            config.data.source = absolute_data_spec(config.data.source)
        if "data" in config and config.data.mixture:
            config.data.mixture = absolute_mixture(config.data.mixture)
