"""The two pieces every section schema (models/options.py, training/options.py,
data/options.py, parallel/options.py) is written with. It imports nothing of jaxmoe but
errors, so a schema module living low in its package can use it."""

from dataclasses import field

from jaxmoe.errors import ConfigError


def option(default, doc: str, choices: tuple = ()):
    """A config key: its default, its one-line doc and, for a choice, the allowed values."""
    return field(default=default, metadata={"doc": doc, "choices": tuple(choices)})


def need(ok: bool, message: str) -> None:
    """A section check: `message` (naming the key and its value) as a one-line ConfigError."""
    if not ok:
        raise ConfigError(message)
