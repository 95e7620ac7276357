"""Configuration: the section schemas and the typed view (schema.py), defaults generated from
them (defaults.py), config files and overrides (loading.py), validation (validation.py),
checkpoints' stored configs (stored.py) and the schema's building blocks (fields.py).

`JobConfig` and `typed` load on first use: the section schemas import `config.fields`, and
an eager import of schema.py here would import them back while they are still loading.
"""

__all__ = ["JobConfig", "typed"]


def __getattr__(name: str):
    if name in __all__:
        from jaxmoe.config import schema

        return getattr(schema, name)
    raise AttributeError(f"module 'jaxmoe.config' has no attribute {name!r}")
