"""Configuration: the section schemas and the typed view (schema.py), defaults generated from
them (defaults.py), config files and overrides (loading.py), validation (validation.py) and
checkpoints' stored configs (stored.py)."""

from jaxmoe.config.schema import JobConfig, typed

__all__ = ["JobConfig", "typed"]
