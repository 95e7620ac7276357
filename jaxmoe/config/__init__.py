"""Configuration: the schema (schema.py: JobConfig, typed), defaults generated from it
(defaults.py), config files and overrides (loading.py), validation (validation.py) and
checkpoints' stored configs (stored.py). The sections' dataclasses live with the code they
configure; jaxmoe/fields.py has what they are written with."""

from jaxmoe.config.schema import JobConfig, typed

__all__ = ["JobConfig", "typed"]
